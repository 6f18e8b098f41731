"""The advantage-estimator registry: built-in levels and rules, and an estimator registered
from outside the package, used by name."""

import types

import numpy as np
import pytest

from jaxrl_agentic.algos import estimators
from jaxrl_agentic.algos.estimators import (
    get_advantage_estimator,
    register_advantage_estimator,
    turn_advantages,
)
from jaxrl_agentic.config import ConfigError, default_config, validate


def episode(group_id, rewards):
    turns = [types.SimpleNamespace(reward=r, state_hash=bytes([k]))
             for k, r in enumerate(rewards)]
    return types.SimpleNamespace(tag="t", group_id=group_id, turns=turns,
                                 score=float(sum(rewards)))


def test_builtin_levels_and_rules():
    for name in ("grpo", "rloo", "reinforce", "gigpo", "turn_grpo"):
        assert get_advantage_estimator(name).level == "turn"
    assert get_advantage_estimator("gae").needs_critic
    assert get_advantage_estimator("reinforce_plus_plus").level == "token"
    assert not get_advantage_estimator("reinforce").group_relative
    with pytest.raises(ValueError, match="needs_critic needs level='token'"):
        register_advantage_estimator("bad", lambda *a: None, needs_critic=True)


def best_in_group(trajectories, keys, settings):
    """A = s − max of the group: every member but the best is pushed down."""
    scores = np.array([t.score for t in trajectories])
    best = {k: max(s for s, k2 in zip(scores, keys, strict=True) if k2 == k) for k in keys}
    return [np.full(len(t.turns), s - best[k], np.float32)
            for t, s, k in zip(trajectories, scores, keys, strict=True)]


def test_an_estimator_registered_from_outside_is_used_by_name():
    register_advantage_estimator("test_best_in_group", best_in_group, group_relative=True)
    try:
        trajs = [episode(0, [1.0, 0.5]), episode(0, [0.5]), episode(1, [2.0]),
                 episode(1, [])]
        got = turn_advantages(trajs, adv_estimator="test_best_in_group")
        np.testing.assert_allclose(got[0], [0.0, 0.0])
        np.testing.assert_allclose(got[1], [-1.0])
        np.testing.assert_allclose(got[2], [0.0])
        assert got[3].shape == (0,)  # never played: no member of its group
        c = default_config()
        c.adv_estimator = "test_best_in_group"
        validate(c)  # a valid run-config choice once registered
        c.train_env_manager.group_size = 1
        with pytest.raises(ConfigError, match="train_env_manager.group_size: .*group_size >= 2"):
            validate(c)
    finally:
        estimators._ESTIMATORS.pop("test_best_in_group")
