"""Each estimator against a hand-computed example."""

import types

import numpy as np
import pytest

from jaxrl_agentic.algos import advantages as adv
from jaxrl_agentic.algos import estimators

S3 = np.sqrt(1 / 3)


def test_grpo_hand_computed_and_singleton_group():
    a = adv.grpo([1, 0, 0, 5], ["g", "g", "g", "solo"])
    # mean 1/3, unbiased std sqrt(1/3)
    np.testing.assert_allclose(a, [(2 / 3) / S3, (-1 / 3) / S3, (-1 / 3) / S3, 0.0], atol=1e-5)
    np.testing.assert_allclose(adv.grpo([1, 0, 0], [0, 0, 0], use_std=False),
                               [2 / 3, -1 / 3, -1 / 3], atol=1e-6)


def test_rloo_is_leave_one_out():
    np.testing.assert_allclose(adv.rloo([1, 0, 0, 7], [0, 0, 0, 1]), [1.0, -0.5, -0.5, 0.0])


def test_reinforce_batch_baseline():
    np.testing.assert_allclose(adv.reinforce([1, 0, 0, 3]), [0, -1, -1, 2])


def test_discounted_returns():
    np.testing.assert_allclose(adv.discounted_returns(np.array([0, 0, 1.0]), 0.5),
                               [0.25, 0.5, 1.0])


def test_gae_hand_computed():
    mask = np.array([0, 1, 1.0])
    a, ret = adv.gae(np.array([0, 0, 1.0]), np.array([0, 0.5, 0.8]), mask, gamma=1.0, lam=1.0)
    np.testing.assert_allclose(a, [0, 0.5, 0.2], atol=1e-6)
    np.testing.assert_allclose(ret, [0, 1.0, 1.0], atol=1e-6)
    a, _ = adv.gae(np.array([0, 0, 1.0]), np.array([0, 0.5, 0.8]), mask, gamma=0.9, lam=0.5)
    np.testing.assert_allclose(a, [0, 0.22 + 0.45 * 0.2, 0.2], atol=1e-6)


def test_reinforce_plus_plus_whitened_returns():
    out = adv.reinforce_plus_plus([np.array([0, 1.0]), np.array([0.0])],
                                  [np.array([1, 1.0]), np.array([1.0])], gamma=1.0)
    s = np.sqrt(2 / 9)
    np.testing.assert_allclose(np.concatenate(out), [(1 / 3) / s, (1 / 3) / s, (-2 / 3) / s],
                               atol=1e-5)


def test_gigpo_anchor_groups_with_distinct_states():
    out = adv.gigpo([1, 0], [0, 0], [np.array([0, 0, 1.0]), np.zeros(3)],
                    [[b"a", b"b", b"c"], [b"a", b"b", b"d"]], step_reward_gamma=0.5)
    r = np.sqrt(0.5)
    np.testing.assert_allclose(out[0], [2 * r, 2 * r, r], atol=1e-4)  # c is a singleton
    np.testing.assert_allclose(out[1], [-2 * r, -2 * r, -r], atol=1e-4)


def test_gigpo_repeated_state_within_an_episode():
    # Episode 2 stays in state a for two turns (e.g. an invalid action): three steps share
    # the anchor a with discounted returns 0.25, 0, 0.
    out = adv.gigpo([1, 0], [0, 0], [np.array([0, 0, 1.0]), np.zeros(3)],
                    [[b"a", b"b", b"c"], [b"a", b"a", b"d"]], step_reward_gamma=0.5)
    r = np.sqrt(0.5)
    a_step = np.array([1 / 6, -1 / 12, -1 / 12]) / np.sqrt(0.0208333333)
    np.testing.assert_allclose(out[0], [r + a_step[0], r, r], atol=1e-4)
    np.testing.assert_allclose(out[1], [-r + a_step[1], -r + a_step[2], -r], atol=1e-4)


def test_gigpo_anchor_groups_do_not_cross_episode_groups():
    # Same state hash in two different groups (different maps) must not be compared.
    out = adv.gigpo([1, 0, 1, 0], [0, 0, 1, 1],
                    [np.array([1.0]), np.array([0.0]), np.array([1.0]), np.array([0.0])],
                    [[b"x"], [b"y"], [b"y"], [b"x"]], step_weight=1.0)
    # every anchor group is a singleton → A = A^E only
    r = np.sqrt(0.5)
    np.testing.assert_allclose(np.concatenate(out), [r, -r, r, -r], atol=1e-4)


def test_turn_grpo_normalises_discounted_turn_returns_over_the_group():
    # Group 0: episode A gets rewards (0.5, 1.5) → returns R = (0.5 + 0.5·1.5, 1.5) =
    # (1.25, 1.5); episode B falls into a hole at once: R = (−1). The three turns are
    # normalised together: mean 7/12, unbiased std √(3.791667/2). Group 1 has one turn: 0.
    out = adv.turn_grpo([0, 0, 1], [np.array([0.5, 1.5]), np.array([-1.0]), np.array([0.5])],
                        step_reward_gamma=0.5)
    mean, std = 7 / 12, np.sqrt(((1.25 - 7 / 12) ** 2 + (1.5 - 7 / 12) ** 2
                                 + (-1 - 7 / 12) ** 2) / 2)
    np.testing.assert_allclose(out[0], [(1.25 - mean) / std, (1.5 - mean) / std], atol=1e-5)
    np.testing.assert_allclose(out[1], [(-1 - mean) / std], atol=1e-5)
    np.testing.assert_allclose(out[2], [0.0])
    # Unlike an outcome estimator, the two turns of one episode get different values, and a
    # good first move of a failed episode can still be credited.
    first_good = adv.turn_grpo([0, 0], [np.array([0.5, -1.0]), np.array([-0.5, -0.5])],
                               step_reward_gamma=0.0)
    assert first_good[0][0] > 0 > first_good[0][1]


def test_whiten_and_validation():
    out = adv.whiten([np.array([1.0, 3.0, 9.0])], [np.array([1, 1, 0.0])])
    np.testing.assert_allclose(out[0], [-1, 1, 0], atol=1e-5)
    with pytest.raises(ValueError, match="cannot be broadcast"):
        estimators.validate_estimator("gae", "step", 4)
    with pytest.raises(ValueError, match="cannot be broadcast"):
        estimators.validate_estimator("reinforce_plus_plus", "step", 4)
    with pytest.raises(ValueError, match="group_size >= 2"):
        estimators.validate_estimator("grpo", "trajectory", 1)
    with pytest.raises(ValueError, match="adv_estimator must be one of"):
        estimators.validate_estimator("ppo", "trajectory", 4)
    estimators.validate_estimator("reinforce", "step", 1)


def _episode(group_id, rewards):
    turns = [types.SimpleNamespace(reward=r, state_hash=bytes([k]))
             for k, r in enumerate(rewards)]
    return types.SimpleNamespace(tag="t", group_id=group_id, turns=turns,
                                 score=float(sum(rewards)))


@pytest.mark.parametrize("estimator", ["grpo", "rloo", "turn_grpo", "gigpo"])
def test_an_episode_that_never_played_is_no_zero_score_member(estimator):
    # Group 0: scores 1, 0 and an episode whose reset failed (no turns). It must not pull
    # the group mean towards 0: the two played episodes get what they get alone.
    with_failed = [_episode(0, [1.0]), _episode(0, [0.0]), _episode(0, [])]
    alone = estimators.turn_advantages(with_failed[:2], adv_estimator=estimator)
    got = estimators.turn_advantages(with_failed, adv_estimator=estimator)
    assert got[2].shape == (0,)
    for a, b in zip(got[:2], alone, strict=True):
        np.testing.assert_array_equal(a, b)
    # grpo by hand: mean 0.5, unbiased std √0.5 → ±0.7071 (with the third at 0: ±1.15/−0.58)
    if estimator == "grpo":
        np.testing.assert_allclose([got[0][0], got[1][0]], [0.5 / np.sqrt(0.5),
                                                            -0.5 / np.sqrt(0.5)], rtol=1e-5)
