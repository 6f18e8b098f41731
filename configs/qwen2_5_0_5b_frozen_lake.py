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
    # A step's few short episodes pack into rows of 8,192 / 2^(i/4) tokens (18 lengths down
    # to 432, each compiled when first used) instead of one 8,192-token row: a batch that
    # fits one row computes at most 1.19× its tokens (tokens/efficiency 0.18 → 0.93 at
    # 4 episodes × 3 turns × 32 tokens; power-of-two rows gave 0.74). Rows go down to 432
    # because in bf16 on CPU samples start at multiples of 128 (sample_align): four
    # ~400-token samples need one 2,048-token row (0.79) or four rows of 432 (0.93). The
    # blocks are recomputed in the backward: the memory plan puts the activations of 24 layers at
    # 8,192 tokens at 17.4 GiB (segment attention), with remat="layer" at 1.4 GiB.
    c.row_len_buckets = 18
    c.row_len_ratio = 2 ** 0.25
    c.remat = "layer"
    c.generation.temperature = 1.0
    c.custom_envs = {"frozen_lake": env_spec("frozen_lake", max_turns=5,
                                             max_tokens_per_step=128, format_penalty=0.1,
                                             is_slippery=False, cell_separator=" ")}
    c.train_env_manager = env_manager(num_env_groups=16, group_size=8, tags=("frozen_lake",))
    c.val_env_manager = env_manager(num_env_groups=64, group_size=1, tags=("frozen_lake",))
    return c
