"""FrozenLake 8×8 with up to 24 moves, on the tiny model: an episode longer than the context.

    python -m jaxrl_agentic.train --config configs/tiny_long_frozen_lake.py

The FrozenLake recipe's settings (configs/frozen_lake.py: turn-level GRPO on shaped rewards,
the action token as the only generated token, short hints, the format warm-up) on an 8×8
map, where start and goal lie up to 14 moves apart. With the tiny model's tokenizer the
first prompt is ~144 tokens and every later turn adds ~122 (the board, redrawn each turn),
so a 24-move episode's whole history is ~3,000 tokens: in a 512-token context the full
history holds 4 turns, and an episode whose goal is farther away ends truncated by length.

`history="window:1"` (rollout/history.py) keeps the system turn, the task and the last turn
(the newest board and hints: all a move depends on): when the next prompt would not fit,
the episode goes on as a new sample from that window (~266 tokens), about every third turn,
so each episode trains as ~8 samples, and its group statistics count it once
(docs/algorithms.md, "Episodes in segments"). `--config.custom_envs.frozen_lake.history=full`
is the comparison: docs/configuration.md.

Measured (2026-12-02, 2-core AMD EPYC dev machine, one core, 10 steps of 4 maps × 4, the
same 40-step warm-up, 16 held-out maps; `--config.max_steps=10 --config.eval_steps=5
--config.eval_before_training=True --config.train_env_manager.num_env_groups=4
--config.val_env_manager.num_env_groups=16 --config.mesh.cpu_devices=1`): before training,
window:1 solved 3 of 16 held-out maps in 10.8 turns on average (3.75 samples an episode,
none cut), full history 2 of 16 in 3.1 turns (half the episodes cut by length); after 10
steps both solved 0 of 16. Ten steps show the mechanism, not learning: that needs a longer run.
"""

import os

from jaxrl_agentic.config import recipe_config


def get_config():
    c = recipe_config(os.path.join(os.path.dirname(os.path.abspath(__file__)),
                                   "frozen_lake.py"))
    c.exp_name = "tiny_long_frozen_lake"
    spec = c.custom_envs.frozen_lake
    spec.max_turns = 24
    spec.env_config.size = 8
    spec.env_config.max_steps_in_episode = 24
    spec.history = "window:1"
    # A turn's prompt stays within 512 tokens under the window; a sample is one segment.
    c.max_input_length = 512
    c.sequence_length = 520
    c.micro_batch_max_tokens = 520
    return c
