"""Qwen2.5-0.5B-Instruct on FrozenLake (for an accelerator).

The model is read from a local Hugging Face directory (nothing is downloaded): put the
checkpoint there and pass its path, e.g.

    python -m jaxrl_agentic.train --config configs/qwen2_5_0_5b_frozen_lake.py \\
        --config.pretrain=/models/Qwen2.5-0.5B-Instruct
"""

from jaxrl_agentic.config import default_config, env_manager, env_spec


def get_config():
    c = default_config()
    c.exp_name = "qwen2_5_0_5b_frozen_lake"
    c.pretrain = "/models/Qwen2.5-0.5B-Instruct"
    c.dtype = "bfloat16"
    c.param_dtype = "float32"
    c.adv_estimator = "grpo"
    c.max_steps = 200
    c.save_steps = 20
    c.eval_steps = 10
    c.learning_rate = 1e-6
    c.lr_scheduler_type = "constant"
    c.mini_batch_size = 32
    c.ppo_epochs = 1
    c.init_kl_coef = 0.001
    c.kl_estimator = "k3"
    c.max_input_length = 3072
    c.sequence_length = 4096
    c.micro_batch_max_tokens = 8192
    # Rows of 8,192 / 2^(i/4) tokens (18 lengths down to 432, each compiled when first used),
    # so a step of a few short episodes is not computed as one 8,192-token row; down to 432
    # because bf16 samples on CPU start at multiples of 128 (docs/real_models.md).
    c.row_len_buckets = 18
    c.row_len_ratio = 2 ** 0.25
    # Recompute each block in the backward: the plan's activations at 8,192 tokens shrink
    # from 17.4 to 1.4 GiB (docs/real_models.md, "The Qwen2.5-0.5B recipes").
    c.remat = "layer"
    c.generation.temperature = 1.0
    c.custom_envs = {"frozen_lake": env_spec("frozen_lake", max_turns=5,
                                             max_tokens_per_step=128, format_penalty=0.1,
                                             is_slippery=False, cell_separator=" ")}
    c.train_env_manager = env_manager(num_env_groups=16, group_size=8, tags=("frozen_lake",))
    c.val_env_manager = env_manager(num_env_groups=64, group_size=1, tags=("frozen_lake",))
    return c
