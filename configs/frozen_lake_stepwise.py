"""FrozenLake with GiGPO: step-wise samples (one per turn) merged by shared prefixes.

    python -m jaxrl_agentic.train --config configs/frozen_lake_stepwise.py
"""

import os

from jaxrl_agentic.config import recipe_config


def get_config():
    c = recipe_config(os.path.join(os.path.dirname(os.path.abspath(__file__)),
                                   "frozen_lake.py"))
    c.exp_name = "frozen_lake_stepwise"
    c.adv_estimator = "gigpo"
    c.sample_mode = "step"
    c.merge_stepwise = True
    c.step_reward_gamma = 0.95
    c.gigpo_step_weight = 1.0
    c.estimated_chunks_per_traj = 0  # automatic: max_turns // 2, corrected as observed
    return c
