"""Collapse diagnostics on a small hand example."""

import numpy as np
import pytest

from jaxrl_agentic.algos.diagnostics import (
    distinct_replies_per_group,
    group_reward_metrics,
    most_common_replies,
    most_common_replies_text,
)

# Two groups of three: group 0 rewards 1, 0, 1 (std √(2/9) = 0.4714), group 1 all 0.5.
REWARDS = [1.0, 0.0, 1.0, 0.5, 0.5, 0.5]
GROUPS = [0, 0, 0, 1, 1, 1]
REPLIES = [(5, 6), (5, 6), (7,), (8, 9), (8, 9), (8, 9)]


def test_group_reward_metrics_by_hand():
    m = group_reward_metrics(REWARDS, GROUPS)
    assert m["batch/group_reward_std"] == pytest.approx(np.sqrt(2 / 9) / 2)
    assert m["batch/zero_variance_groups"] == 0.5
    assert group_reward_metrics([], [])["batch/group_reward_std"] == 0.0


def test_distinct_and_most_common_replies():
    # group 0: {(5, 6), (7,)} → 2, group 1: {(8, 9)} → 1
    assert distinct_replies_per_group(REPLIES, GROUPS) == {
        "batch/distinct_replies_per_group": 1.5}
    assert most_common_replies(REPLIES, top_n=2) == [((8, 9), 3), ((5, 6), 2)]
    text = most_common_replies_text(REPLIES, top_n=2, decode=lambda ids: f"a|{ids[0]}")
    assert text.splitlines()[2:] == ["| 3 | 50% | a\\|8 |", "| 2 | 33% | a\\|5 |"]

