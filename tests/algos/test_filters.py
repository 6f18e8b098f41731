"""DAPO filters: zero-variance groups, truncation, soft overlong punishment by hand."""

import numpy as np
import pytest

from jaxrl_agentic.algos.filters import (
    dynamic_sampling_keep,
    groups_with_signal,
    mask_truncated,
    overlong_penalty,
    truncated_samples,
    zero_variance_groups,
)


def test_zero_variance_groups_by_hand():
    # group 7: all 1 (degenerate); group 3: 0 and 1; group 5: one sample (degenerate);
    # group 9: equal up to float noise (degenerate with the default tol, not with tol=0).
    rewards = [1.0, 0.0, 1.0, 1.0, 0.5, 0.3, 0.1 + 0.2]
    groups = [7, 3, 3, 7, 5, 9, 9]
    ids, degenerate = zero_variance_groups(rewards, groups)
    np.testing.assert_array_equal(ids, [3, 5, 7, 9])
    np.testing.assert_array_equal(degenerate, [False, True, True, True])
    _, exact = zero_variance_groups(rewards, groups, tol=0.0)
    np.testing.assert_array_equal(exact, [False, True, True, False])
    np.testing.assert_array_equal(dynamic_sampling_keep(rewards, groups),
                                  [False, True, True, False, False, False, False])


def test_truncated_samples_and_mask():
    truncated = truncated_samples(["eos", "length", "stop", "eos"],
                                  prompt_lengths=[10, 10, 10, 40], max_prompt_length=32,
                                  total_lengths=[50, 60, 70, 45], sequence_length=64)
    np.testing.assert_array_equal(truncated, [False, True, True, True])
    masks = [np.ones(3), np.ones(2), np.ones(4), np.array([0.0, 1.0])]
    out = mask_truncated(masks, truncated)
    assert out[0] is masks[0] and all(not m.any() for m in out[1:])
    with pytest.raises(ValueError, match="needs"):
        truncated_samples()


def test_overlong_penalty_values():
    # L_max = 100, L_cache = 20, P = 0.5: free up to 80, linear to −0.5 at 100, −0.5 beyond.
    lengths = [10, 80, 81, 90, 100, 101, 500]
    expected = [0.0, 0.0, -0.025, -0.25, -0.5, -0.5, -0.5]
    got = overlong_penalty(lengths, 100, overlong_penalty_length=20, overlong_penalty=0.5)
    np.testing.assert_allclose(got, expected, atol=1e-7)
    with pytest.raises(ValueError, match="overlong_penalty_length"):
        overlong_penalty(lengths, 10, overlong_penalty_length=20)


def test_groups_with_signal_reads_the_advantages():
    # Group 7: all-zero advantages (per turn, one member never played a turn); group 3: one
    # member has a per-turn advantage above the tolerance; group 5: only float noise.
    advantages = [np.zeros(2), np.zeros(0), np.array([0.0, -0.3]), np.zeros(1),
                  np.array([1e-9]), np.array([-1e-9])]
    keep = groups_with_signal(advantages, [7, 7, 3, 3, 5, 5])
    np.testing.assert_array_equal(keep, [False, False, True, True, False, False])
