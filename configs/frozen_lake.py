"""FrozenLake 4×4 with the tiny default model: GRPO, trajectory-wise samples (StarPO).

    python -m jaxrl_agentic.train --config configs/frozen_lake.py
"""

from jaxrl_agentic.config import default_config, env_manager, env_spec


def get_config():
    c = default_config()
    c.exp_name = "frozen_lake"
    c.pretrain = "tiny"
    c.adv_estimator = "grpo"
    c.sample_mode = "trajectory"
    c.max_steps = 200
    c.save_steps = 25
    c.eval_steps = 10
    c.learning_rate = 3e-4
    c.lr_scheduler_type = "cosine"
    c.warmup_steps = 5
    c.min_lr_ratio = 0.1
    c.mini_batch_size = 32
    # Attention is dense within a packed row, so shorter rows cost less per real token.
    c.max_input_length = 768
    c.sequence_length = 800
    c.micro_batch_max_tokens = 1024
    c.generation.temperature = 1.0
    # Teach the reply format first (random valid actions), so RL teaches the policy.
    c.format_warmup.steps = 40
    c.format_warmup.learning_rate = 2e-3
    c.custom_envs = {"frozen_lake": env_spec("frozen_lake", max_turns=6, max_tokens_per_step=16,
                                             format_penalty=0.1, cell_separator=" ", hints=True,
                                             progress_reward=0.0, brief_instructions=True)}
    c.train_env_manager = env_manager(num_env_groups=8, group_size=8, tags=("frozen_lake",))
    c.val_env_manager = env_manager(num_env_groups=32, group_size=1, tags=("frozen_lake",))
    return c
