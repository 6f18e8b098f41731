"""FrozenLake with an advantage estimator of its own: group ranks instead of z-scores.

    python -m jaxrl_agentic.train --config docs/examples/custom_advantage_estimator.py

Each episode's advantage is its centred rank among the episodes of its group, scaled to
[−1, 1]; ties share their mean rank, so a group of equal scores gets 0 everywhere:

    A_i = (rank_g(s_i) − (n − 1)/2) / ((n − 1)/2)

Ranks ignore how far apart the scores are, which keeps one lucky outlier (a large shaped
return) from dominating the group. Registered at the "turn" level (every turn of an episode
gets its scalar), group-relative (it needs group_size ≥ 2, which validation now checks).
"""

import os

import numpy as np

from jaxrl_agentic.algos.estimators import register_advantage_estimator
from jaxrl_agentic.config import recipe_config


def group_rank(trajectories, keys, settings):
    """One array of per-turn advantages per trajectory (algos/estimators.py's contract)."""
    scores = np.array([t.score for t in trajectories], np.float64)
    advantages = np.zeros(len(trajectories))
    for key in set(keys):
        members = [i for i, k in enumerate(keys) if k == key]
        n = len(members)
        if n < 2:
            continue
        values = scores[members]
        ranks = np.array([(values < v).sum() + ((values == v).sum() - 1) / 2 for v in values])
        advantages[members] = (ranks - (n - 1) / 2) / ((n - 1) / 2)
    return [np.full(len(t.turns), a, np.float32) for t, a in zip(trajectories, advantages,
                                                                   strict=True)]


# replace=True: a config file may be loaded more than once in a process.
register_advantage_estimator("group_rank", group_rank, level="turn", group_relative=True,
                             replace=True)


def get_config():
    c = recipe_config(os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "..",
                                   "configs", "frozen_lake.py"))
    c.exp_name = "frozen_lake_group_rank"
    c.adv_estimator = "group_rank"
    return c
