"""Sokoban 6×6 with one box and the tiny default model (GRPO, trajectory-wise).

    python -m jaxrl_agentic.train --config configs/sokoban.py
"""

from jaxrl_agentic.config import default_config, env_manager, env_spec


def get_config():
    c = default_config()
    c.exp_name = "sokoban"
    c.pretrain = "tiny"
    c.adv_estimator = "grpo"
    c.max_steps = 300
    c.save_steps = 25
    c.eval_steps = 10
    c.learning_rate = 3e-4
    c.lr_scheduler_type = "cosine"
    c.warmup_steps = 5
    c.min_lr_ratio = 0.1
    c.mini_batch_size = 32
    c.max_input_length = 1280
    c.sequence_length = 1536
    c.micro_batch_max_tokens = 3072
    c.custom_envs = {"sokoban": env_spec("sokoban", max_turns=10, max_tokens_per_step=16,
                                         format_penalty=0.1, dim_room=6, num_boxes=1,
                                         cell_separator=" ")}
    c.train_env_manager = env_manager(num_env_groups=8, group_size=8, tags=("sokoban",))
    c.val_env_manager = env_manager(num_env_groups=32, group_size=1, tags=("sokoban",))
    return c
