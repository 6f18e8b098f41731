"""FrozenLake 4×4 with the tiny default model writing its whole reply: `<answer>ACTION</answer>`
and its EOS are all generated (no `reply_prefix` / `reply_suffix`), as in every real use.

    python -m jaxrl_agentic.train --config configs/frozen_lake_full_reply.py

The default recipe (`configs/frozen_lake.py`) with the model writing the tags (up to 6 new
tokens a turn: the reply is 3 tokens and EOS with the tiny tokenizer), a gradient clip at
0.25, and the default's earlier training batch of 8 maps × 8 episodes. Measured result:
docs/benchmarks.md, "Full replies"; why the head is untied and the clip is 0.25:
docs/notes/reply_format.md.
"""

import os

from jaxrl_agentic.config import recipe_config


def get_config():
    c = recipe_config(os.path.join(os.path.dirname(os.path.abspath(__file__)),
                                   "frozen_lake.py"))
    c.exp_name = "frozen_lake_full_reply"
    c.reply_prefix = ""
    c.reply_suffix = ""
    # With the tied head a decision token after a generated tag is not learned at all.
    c.untie_word_embeddings = True
    c.custom_envs.frozen_lake.max_tokens_per_step = 6
    # Four loss tokens a turn make the token-mean gradient about a quarter of the one-token
    # recipe's: at 0.25 every update is clipped, as the one-token recipe's are at 1.0.
    c.max_grad_norm = 0.25
    # The batch the recipe's result was measured with (16 × 4 is not measured here).
    c.train_env_manager.num_env_groups = 8
    c.train_env_manager.group_size = 8
    return c
