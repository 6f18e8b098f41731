"""Sokoban 6×6 with one box and the tiny default model: turn-level GRPO on shaped rewards,
trajectory-wise samples; the model generates only the action token. Eval samples its
replies at T = 0.5, as RAGEN's does.

    python -m jaxrl_agentic.train --config configs/sokoban.py

It carries over what FrozenLake needed to learn (configs/frozen_lake.py): a per-move signal,
short hints, a one-token reply, an untied head, lr 1e-3 with a KL to the warmed model.
Measured result: docs/benchmarks.md, "Sokoban". How the settings were found, and the
options tried: docs/notes/sokoban_recipe.md.
"""

from jaxrl_agentic.config import default_config, env_manager, env_spec


def get_config():
    c = default_config()
    c.exp_name = "sokoban"
    c.pretrain = "tiny"
    # Each move is judged by the shaped rewards of the next turn or two, relative to the
    # other moves on the same level (as in configs/frozen_lake.py).
    c.adv_estimator = "turn_grpo"
    c.step_reward_gamma = 0.5
    # The model generates only ACTION; `<answer>`/`</answer>` are context and parser text
    # (why: docs/notes/reply_format.md).
    c.reply_prefix = "<answer>"
    c.reply_suffix = "</answer>"
    c.sample_mode = "trajectory"
    c.untie_word_embeddings = True
    c.max_steps = 300
    c.save_steps = 25
    c.eval_steps = 10
    c.learning_rate = 1e-3
    c.lr_scheduler_type = "cosine"
    c.warmup_steps = 5
    c.min_lr_ratio = 0.1
    c.mini_batch_size = 16
    # One JAX device per core (as configs/frozen_lake.py): the tiny model's learner step
    # splits its rows over them.
    c.mesh.cpu_devices = 0
    c.init_kl_coef = 0.15
    # 10 turns of a ~90-token board and hint: under 1,100 tokens.
    c.max_input_length = 1280
    c.sequence_length = 1296
    c.micro_batch_max_tokens = 1296
    c.generation.temperature = 1.0
    # Teach the reply format first (random valid actions), so RL teaches the policy: the
    # tiny model never writes a valid action on its own, and with every reply invalid all
    # returns in a group are equal, so every advantage and the gradient are 0.
    c.format_warmup.steps = 40
    c.format_warmup.learning_rate = 2e-3
    # Shaped rewards (envs/sokoban.py): +1 per unit of potential gained (a box a step closer
    # to its target, or the player half a unit closer to the box), −0.5 for a move that
    # changed nothing (a wall, a blocked box), −1 for an invalid reply; the game's own −0.1
    # a step, +1 a box on target, +10 solved. Success is only a solved level. Without a
    # per-move signal, returns within a group differ only by luck and nothing is learned.
    # push_potential, revisit_penalty and blocked_hints stay off: each changed which seed
    # learned, not how many (docs/notes/sokoban_recipe.md).
    c.custom_envs = {"sokoban": env_spec("sokoban", max_turns=10, max_tokens_per_step=1,
                                         format_penalty=1.0, dim_room=6, num_boxes=1,
                                         cell_separator=" ", hints=True, progress_reward=1.0,
                                         bump_penalty=0.5, brief_instructions=True,
                                         push_potential=False, revisit_penalty=0.0,
                                         revisit_memory=0)}
    # 8 levels of 8 episodes: FrozenLake's 16 × 4 helped one seed here and not the other.
    c.train_env_manager = env_manager(num_env_groups=8, group_size=8, tags=("sokoban",))
    # 64 held-out levels: the standard error of eval/success near 0.3 is 0.057.
    c.val_env_manager = env_manager(num_env_groups=64, group_size=1, tags=("sokoban",))
    # Eval replies sampled at T = 0.5, RAGEN's validation protocol, under which the published
    # Qwen2.5-0.5B figure (0.203) was measured, so eval/success compares with it. Greedy
    # (`--config.eval_temperature=0`) is stricter: a policy that bumps into a wall repeats it.
    c.eval_temperature = 0.5
    return c
