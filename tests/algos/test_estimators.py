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


def _played(group_id, member, rewards, segment=0):
    from jaxrl_agentic.data.trajectory import Trajectory, Turn

    turns = [Turn(context_len=4 * k, generated=[1], logprobs=np.zeros(1, np.float32),
                  stop_reason="eos", eos_appended=False, reward=r, action=0,
                  action_is_valid=True, action_is_effective=True, success=r > 0,
                  done=False, state_hash=bytes([k])) for k, r in enumerate(rewards)]
    return Trajectory(traj_id=10 * member + segment, group_id=group_id, tag="t", seed=0,
                      tokens=[0] * (4 * len(rewards)), turns=turns, member=member,
                      segment=segment)


@pytest.mark.parametrize("name", ["grpo", "rloo", "turn_grpo"])
def test_an_episode_in_segments_is_one_member_of_its_group(name):
    """An outside agent that rewrote its history leaves an episode in two samples, its
    reward on the last. Counted as two members (the bug), its group of scores [1, 0, 1]
    would become [0, 1, 0, 1]; joined, each segment gets the whole episode's advantage."""
    split = [_played(0, 0, [0.0]), _played(0, 0, [1.0], segment=1)]
    others = [_played(0, 1, [0.0]), _played(0, 2, [1.0])]
    got = turn_advantages(others[:1] + split + others[1:], adv_estimator=name)
    whole = turn_advantages([_played(0, 0, [0.0, 1.0])] + others, adv_estimator=name)
    np.testing.assert_allclose(np.concatenate(got[1:3]), whole[0])
    np.testing.assert_allclose(got[0], whole[1])
    np.testing.assert_allclose(got[3], whole[2])
    if name == "grpo":  # by hand: scores [1, 0, 1], mean 2/3, unbiased std 1/√3
        np.testing.assert_allclose(got[1], [(1 - 2 / 3) * np.sqrt(3)], rtol=1e-5)
    with pytest.raises(ValueError, match="segments"):
        estimators.token_advantages(split, adv_estimator="reinforce_plus_plus")
    with pytest.raises(ValueError, match="has segments \\[0, 2\\]"):
        turn_advantages([split[0], _played(0, 0, [1.0], segment=2)], adv_estimator=name)
