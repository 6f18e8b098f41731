"""The run config → its typed tree: one conversion, every field in one place, defaults that
agree, rules stated once."""

import dataclasses

import pytest

from jaxrl_agentic import run_config as typed_configs
from jaxrl_agentic.config import ConfigError, default_config, validate
from jaxrl_agentic.run_config import build_run_config
from jaxrl_agentic.training.critic import CriticConfig
from jaxrl_agentic.training.learner_config import LearnerConfig
from jaxrl_agentic.training.teacher import DistillationConfig


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
    assert typed_configs.distillation_config(c) == DistillationConfig()


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


# A value other than the default for every flat field whose default is a string (the others
# are flipped, incremented or scaled): each must change the tree somewhere.
OTHER_STRINGS = {
    "exp_name": "other", "output_dir": "/tmp/o", "logging_dir": "/tmp/l",
    "render_save_dir": "/tmp/r", "resume_from_checkpoint": "latest", "pretrain": "/m",
    "dtype": "bfloat16", "param_dtype": "bfloat16", "adv_estimator": "reinforce",
    "sample_mode": "step", "reward_norm_by": "batch", "kl_estimator": "k1",
    "loss_reduction": "seq_mean_token_mean", "policy_loss": "gspo", "tis_level": "sequence",
    "tis_mode": "mask", "rollout_batching": "continuous", "kernel_impl": "reference",
    "attention_impl": "reference", "remat": "layer", "lr_scheduler_type": "cosine",
    "system_prompt": "be brief", "reply_prefix": "<a>", "reply_suffix": "</a>",
    "debug.dump_dir": "/tmp/d", "distributed.coordinator_address": "h:1",
    "sampler_backend": "other", "lora_train_head": "never", "env_id": "gymnax:CartPole-v1",
    "format_warmup.lr_schedule": "cosine", "distill_mode": "only", "teacher.pretrain": "/t",
    "distill_loss": "forward_kl",
    "teacher.dtype": "bfloat16",
}


# Numbers whose scaled default breaks the field's own rule.
OTHER_NUMBERS = {"dual_clip": 3.0, "min_lr_ratio": 0.5, "generation.top_p": 0.5}


def _other(path: str, value):
    if path in OTHER_NUMBERS:
        return OTHER_NUMBERS[path]
    if isinstance(value, bool):
        return not value
    if isinstance(value, str):
        return OTHER_STRINGS[path]
    if isinstance(value, int):
        return value + 3 if value >= 0 else 1
    if isinstance(value, float):
        return value * 0.5 + 0.125
    if path == "lora_targets":
        return ("q_proj",)
    if path == "format_warmup.replies":
        return ("[1]",)
    if isinstance(value, tuple):
        return (*value, 3)
    raise AssertionError(f"no other value for {path}={value!r}")


def _leaf_fields(c, prefix=""):
    for key, value in c.items():
        if key in ("custom_envs", "train_env_manager", "val_env_manager"):
            continue  # structured: covered by the env tests
        if hasattr(value, "items"):
            yield from _leaf_fields(value, f"{prefix}{key}.")
        else:
            yield f"{prefix}{key}", value


def _set(c, path: str, value):
    *parents, last = path.split(".")
    for p in parents:
        c = c[p]
    c[last] = value


def _tree(c):
    return dataclasses.replace(build_run_config(c), source_json="")


def _needs(c, path: str):
    """The settings under which field `path` matters (set on both sides of the comparison)."""
    if path in ("critic_learning_rate", "value_clip"):
        c.adv_estimator = "gae"
    if path == "logprob_under_sampling_filter":
        c.generation.top_k = 5
    if path == "loss_norm_length":
        c.loss_reduction = "seq_mean_token_sum_norm"
    if path == "tis_imp_ratio_cap":
        c.recompute_old_logprobs = True
    if path in ("kl_in_reward", "target_kl"):
        c.init_kl_coef = 0.1
    if path == "tis_lower_cap":
        c.tis_mode, c.tis_imp_ratio_cap, c.recompute_old_logprobs = "mask", 2.0, True
    if path.startswith("distributed.") and path != "distributed.enabled":
        c.distributed.num_processes, c.distributed.process_id = 2, 0
    return c


def test_every_flat_field_reaches_the_tree():
    """No field is lost on the way to the typed tree, which is all the pipeline reads: for
    each field of `default_config()`, another value gives another tree."""
    fields = list(_leaf_fields(default_config()))
    assert len(fields) > 90
    for path, value in fields:
        c = _needs(default_config(), path)
        base = _tree(c)
        _set(c, path, _other(path, value))
        assert _tree(c) != base, path


def test_the_tree_reads_every_env_tag_and_split():
    c = default_config()
    c.custom_envs.frozen_lake.max_turns = 7
    c.custom_envs.frozen_lake.env_config = {"p_frozen": 0.9}
    c.train_env_manager.env_config = {"p_frozen": 0.7}
    c.generation.num_return_sequences = 2
    cfg = build_run_config(c)
    env = cfg.envs["frozen_lake"]
    assert (env.max_turns, env.backend, env.generation.temperature) == (7, "auto", 1.0)
    assert cfg.max_turns == 7 and cfg.max_tokens_per_step == 64
    # n return sequences per initial state: n episodes per group member.
    assert cfg.train.manager.group_size == 2 * c.train_env_manager.group_size
    assert cfg.val.manager.group_size == c.val_env_manager.group_size
    assert cfg.split_env_config("train", "frozen_lake") == {"p_frozen": 0.7}
    assert cfg.split_env_config("val", "frozen_lake") == {"p_frozen": 0.9}
    assert cfg.run.logging_dir == "outputs/default/tensorboard"


def test_no_module_past_the_entry_points_reads_the_flat_config():
    """The pipeline, the warm-up and the parts take the typed tree: their source names no
    flat-only field (the dict's spellings of what the tree renames or nests)."""
    import pathlib
    import re

    import jaxrl_agentic

    root = pathlib.Path(jaxrl_agentic.__file__).parent
    entry = {"config.py", "env_specific.py", "run_config.py", "train.py", "play.py",
             "evaluate.py"}
    # Outside quotes: an error message may name the field the user wrote.
    flat = re.compile(r"(?<![\"'\w])\w+\.(custom_envs|train_env_manager|val_env_manager|"
                      r"adv_estimator|rollout_batching|rollout_slots|whiten_advantages|"
                      r"advantage_clip|norm_adv_std)\b")
    offenders = [f"{path.relative_to(root)}: {m.group(0)}"
                 for path in root.rglob("*.py") if path.name not in entry
                 for m in flat.finditer(path.read_text())]
    assert offenders == []


@pytest.mark.parametrize("tied", [True, False], ids=["tied", "untied"])
def test_lora_auto_trains_the_head_only_when_loading_unties_a_tied_one(tied, tmp_path):
    """`lora_train_head="auto"` with `untie_word_embeddings=True`: a tied checkpoint (the
    tiny models, Qwen2.5-0.5B) loads with a copy of its embedding as head, which trains
    beside the adapters; an untied one (Qwen2.5-7B) loads its own head, which stays frozen
    (docs/configuration.md, `lora_train_head`)."""
    from flax import nnx

    from jaxrl_agentic.models import lora, save_pretrained
    from jaxrl_agentic.models.hf_io import read_model_config
    from jaxrl_agentic.models.transformer import Transformer
    from tests.training.test_learner import MODEL_CFG

    path = str(tmp_path / "model")
    save_pretrained(Transformer(dataclasses.replace(MODEL_CFG, tie_word_embeddings=tied),
                                rngs=nnx.Rngs(0)), None, path)
    c = default_config()
    c.pretrain, c.untie_word_embeddings, c.lora_rank = path, True, 4
    validate(c)
    config = build_run_config(c).model.lora
    assert config.trains_head is tied
    # What the pipeline builds from it: the loaded model's parts trained in full.
    loaded = Transformer(read_model_config(path, untie_word_embeddings=True), rngs=nnx.Rngs(0))
    assert lora.trained_in_full(lora.add_lora(loaded, config)) == (
        [("lm_head", "kernel")] if tied else [])
    c.untie_word_embeddings = False  # a tied head cannot train; an untied one is not asked
    assert not build_run_config(c).model.lora.trains_head
    c.lora_train_head = "always"
    assert build_run_config(c).model.lora.trains_head


def test_lora_auto_trains_the_tiny_models_untied_head():
    c = default_config()
    c.untie_word_embeddings, c.lora_rank = True, 4
    for name in ("tiny", "tiny-tools"):  # tied: decided without building them
        c.pretrain = name
        assert build_run_config(c).model.lora.trains_head
