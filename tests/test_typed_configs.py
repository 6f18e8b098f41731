"""The run config → typed configs: one conversion, defaults that agree, rules stated once."""

import dataclasses

import pytest

from jaxrl_agentic import typed_configs
from jaxrl_agentic.config import ConfigError, default_config, validate
from jaxrl_agentic.training.critic import CriticConfig
from jaxrl_agentic.training.learner_config import LearnerConfig


def test_typed_defaults_equal_the_run_defaults():
    """A typed config built with no arguments is the one the run's defaults give: a default
    changed on one side only (LearnerConfig once had lr 1e-6, fixed_rows False and
    rows_bucket 0 against the run's 1e-5, True and 4) fails here."""
    c = default_config()
    # Except the loss slots per row: the run's 0 = automatic is resolved from the envs'
    # generation budgets, which a PackingConfig does not know (its 0 = the whole row).
    packing = dataclasses.replace(LearnerConfig().packing, loss_slots=typed_configs.loss_slots(c))
    assert 0 < packing.loss_slots < packing.micro_batch_max_tokens
    assert typed_configs.learner_config(c) == dataclasses.replace(LearnerConfig(),
                                                                  packing=packing)
    # The critic's learning rate is the run's critic_learning_rate, not learning_rate.
    assert typed_configs.critic_config(c) == dataclasses.replace(
        CriticConfig(), learning_rate=c.critic_learning_rate, packing=packing)
    assert typed_configs.packing_config(c) == packing


def test_run_config_fields_reach_the_typed_configs():
    c = default_config()
    c.kl_horizon = 123.0
    c.micro_batch_max_tokens, c.sequence_length, c.rows_bucket = 640, 320, 2
    c.generation.stop_token_ids = (7, 9)
    learner = typed_configs.learner_config(c, pad_token_id=5)
    assert learner.kl_horizon == 123.0
    assert (learner.packing.micro_batch_max_tokens, learner.packing.sequence_length,
            learner.packing.rows_bucket, learner.packing.pad_token_id) == (640, 320, 2, 5)
    assert typed_configs.critic_config(c).packing == typed_configs.packing_config(c)
    spec = c.custom_envs.frozen_lake
    assert typed_configs.generation_config(c, spec).stop_token_ids == (7, 9)


@pytest.mark.parametrize("field, value, fragment", [
    ("kl_horizon", 0.0, "config.kl_horizon: must be > 0"),
    ("kl_in_reward", True, "config.kl_in_reward: folds init_kl_coef"),
    ("kernel_impl", "cuda", "config.kernel_impl: choose one of auto, reference"),
    ("rows_bucket", -1, "config.rows_bucket"),
])
def test_typed_rules_surface_as_config_errors(field, value, fragment):
    c = default_config()
    c[field] = value
    with pytest.raises(ConfigError, match="^" + fragment.replace("(", r"\(")):
        validate(c)


def test_env_manager_rules_name_the_manager():
    c = default_config()
    c.train_env_manager.num_groups_partition = (3,)
    with pytest.raises(ConfigError, match="^config.train_env_manager.num_groups_partition: "
                                          "needs one entry per tag summing to"):
        validate(c)


@pytest.mark.parametrize("fields, fragment", [
    ({"policy_loss": "grpo"}, "config.policy_loss: choose one of"),
    ({"policy_loss": "gspo", "dual_clip": 3.0}, "config.dual_clip: bounds PPO's token loss"),
    ({"tis_level": "segment"}, "config.tis_level: choose one of"),
    ({"tis_mode": "clip"}, "config.tis_mode: choose one of"),
    ({"tis_imp_ratio_cap": 2.0}, "config.tis_imp_ratio_cap: needs recompute_old_logprobs"),
    ({"logprob_under_sampling_filter": True},
     "config.logprob_under_sampling_filter: needs generation top_k > 0 or top_p < 1"),
    ({"dynamic_sampling": True, "async_generation_ratio": 1},
     "config.dynamic_sampling: extra rounds are played with the current params"),
    ({"dynamic_sampling_max_rounds": 0}, "config.dynamic_sampling_max_rounds: must be"),
    ({"overlong_penalty_length": 1000}, "config.overlong_penalty_length: 1000 > the smallest"),
    ({"loss_norm_length": -1}, "config.loss_norm_length: must be an integer >= 0"),
])
def test_incompatible_algorithm_settings_are_one_line_errors(fields, fragment):
    c = default_config()
    c.update(fields)
    with pytest.raises(ConfigError, match="^" + fragment.replace("(", r"\(")) as e:
        validate(c)
    assert "\n" not in str(e.value)


def test_dynamic_sampling_needs_groups_of_two():
    c = default_config()
    c.dynamic_sampling = True
    c.adv_estimator = "reinforce"
    c.train_env_manager.group_size = 1
    with pytest.raises(ConfigError, match="^config.dynamic_sampling: a group of one"):
        validate(c)


@pytest.mark.parametrize("sample_mode, expected", [("trajectory", 5 * 16), ("step", 16)])
def test_dr_grpo_normaliser_defaults_to_the_generation_budget(sample_mode, expected):
    c = default_config()
    c.loss_reduction = "seq_mean_token_sum_norm"
    c.sample_mode = sample_mode
    c.custom_envs.frozen_lake.max_turns = 5
    c.custom_envs.frozen_lake.max_tokens_per_step = 16
    assert typed_configs.learner_config(c).loss_norm_length == expected
    c.loss_norm_length = 7
    assert typed_configs.learner_config(c).loss_norm_length == 7
    c.loss_reduction = "token_mean"
    assert typed_configs.learner_config(c).loss_norm_length is None


@pytest.mark.parametrize("dtype, attention_impl, sample_align, expected", [
    ("bfloat16", "auto", 0, 128),       # CPU: the learner's attention is block-sparse
    ("bfloat16", "reference", 0, 1),    # dense learner attention: nothing to line up
    ("float32", "auto", 0, 1),          # fp32 sides agree to ~1e-6: no padding for it
    ("float32", "auto", 16, 16),        # an explicit value is kept
])
def test_sample_align_is_the_attention_block_in_bf16_on_the_block_sparse_path(
        dtype, attention_impl, sample_align, expected):
    c = default_config()
    c.dtype, c.attention_impl, c.sample_align = dtype, attention_impl, sample_align
    assert typed_configs.packing_config(c).sample_align == expected


def test_sample_align_must_not_be_negative():
    c = default_config()
    c.sample_align = -1  # (0 = automatic; ConfigDict refuses a non-integer itself)
    with pytest.raises(ConfigError, match="^config.sample_align: must be >= 0, got -1"):
        validate(c)


def test_cudnn_attention_off_a_gpu_is_a_one_line_config_error():
    c = default_config()
    c.attention_impl = "cudnn"  # tests run on CPU
    with pytest.raises(ConfigError, match="^config.attention_impl: 'cudnn' needs an NVIDIA "
                                          "GPU \\(JAX runs on 'cpu'\\)$"):
        validate(c)
