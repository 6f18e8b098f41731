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
    # Teach the reply format first (random valid actions), so RL teaches the policy: the
    # tiny model never writes a valid `<answer>…</answer>` on its own, and with every reply
    # invalid all returns in a group are equal, so every advantage and the gradient are 0.
    c.format_warmup.steps = 40
    c.format_warmup.learning_rate = 2e-3
    # An invalid reply costs more than a move (−0.1 a step), so a group whose members differ
    # in format has an advantage signal even before any box reaches a target (at 0.1 the two
    # cost the same).
    c.custom_envs = {"sokoban": env_spec("sokoban", max_turns=10, max_tokens_per_step=16,
                                         format_penalty=1.0, dim_room=6, num_boxes=1,
                                         cell_separator=" ")}
    c.train_env_manager = env_manager(num_env_groups=8, group_size=8, tags=("sokoban",))
    c.val_env_manager = env_manager(num_env_groups=32, group_size=1, tags=("sokoban",))
    return c
