"""Truncated importance sampling: levels × modes by hand, packing, overflow, metrics."""

import jax.numpy as jnp
import numpy as np
import pytest

from jaxrl_agentic.algos.importance import (
    TIS_LEVELS,
    TIS_MODES,
    importance_weights,
    tis_metrics,
)

# One row, two samples and padding. log ρ = log π_old − log μ per token:
#   seg 1: ρ = 3, 0.5, (prompt token, mask 0, garbage), 1.5
#   seg 2: ρ = 1.2, 0.9
RHO = np.array([3.0, 0.5, 1.0, 1.5, 1.2, 0.9, 1.0])
MASK = np.array([1, 1, 0, 1, 1, 1, 0])
SEG = np.array([1, 1, 1, 1, 2, 2, 0])
MU = np.array([-1.0, -2.0, np.nan, -0.5, -0.3, -1.1, np.inf])
OLD = MU + np.log(RHO)


def _weights(level, mode, cap=2.0, **kw):
    args = [jnp.asarray(x, jnp.float32) for x in (OLD, MU, MASK)]
    return importance_weights(*args, jnp.asarray(SEG), level=level, mode=mode, cap=cap, **kw)


def test_token_level_by_hand():
    t = _weights("token", "truncate")
    np.testing.assert_allclose(t.weights, [2.0, 0.5, 0, 1.5, 1.2, 0.9, 0], rtol=1e-6)
    np.testing.assert_array_equal(t.capped, [1, 0, 0, 0, 0, 0, 0])
    m = _weights("token", "mask", lower_cap=0.25)
    np.testing.assert_allclose(m.weights, [0.0, 0.5, 0, 1.5, 1.2, 0.9, 0], rtol=1e-6)


@pytest.mark.parametrize("level", TIS_LEVELS)
def test_mask_mode_drops_weights_below_the_lower_bound_too(level):
    # verl's rollout-IS mask keeps w in [lower, upper], lower = 1/upper by default. One
    # sample per level: ρ = 0.3 on every token (so token, sequence-of-1 and geometric
    # agree) is below 1/2 and masked; ρ = 0.8 is kept; ρ = 3 is above 2 and masked.
    rho = np.array([0.3, 0.8, 3.0])
    mu = np.array([-1.0, -2.0, -0.5])
    args = [jnp.asarray(x, jnp.float32) for x in (mu + np.log(rho), mu, np.ones(3))]
    seg = jnp.asarray([1, 2, 3])
    m = importance_weights(*args, seg, level=level, mode="mask", cap=2.0)
    np.testing.assert_allclose(m.weights, [0.0, 0.8, 0.0], rtol=1e-6)
    np.testing.assert_array_equal(m.capped, [True, False, True])
    # An explicit lower bound; truncate mode has no lower bound (verl's TIS is min(ρ, C)).
    m = importance_weights(*args, seg, level=level, mode="mask", cap=2.0, lower_cap=0.1)
    np.testing.assert_allclose(m.weights, [0.3, 0.8, 0.0], rtol=1e-6)
    t = importance_weights(*args, seg, level=level, mode="truncate", cap=2.0)
    np.testing.assert_allclose(t.weights, [0.3, 0.8, 2.0], rtol=1e-6)
    with pytest.raises(ValueError, match="lower cap"):
        importance_weights(*args, seg, level=level, mode="mask", cap=2.0, lower_cap=3.0)


def test_sequence_level_by_hand():
    # seg 1: Π ρ = 3·0.5·1.5 = 2.25 > 2 → truncated to 2 / masked; seg 2: 1.08.
    t = _weights("sequence", "truncate")
    np.testing.assert_allclose(t.weights, [2, 2, 0, 2, 1.08, 1.08, 0], rtol=1e-5)
    np.testing.assert_array_equal(t.capped, [1, 1, 0, 1, 0, 0, 0])
    m = _weights("sequence", "mask")
    np.testing.assert_allclose(m.weights, [0, 0, 0, 0, 1.08, 1.08, 0], rtol=1e-5)


def test_geometric_level_by_hand():
    # seg 1: 2.25^(1/3) = 1.3104 (3 loss tokens; the prompt token does not count), seg 2:
    # √1.08 = 1.0392. With C = 1.2 seg 1 is capped.
    g = 2.25 ** (1 / 3)
    t = _weights("geometric", "truncate", cap=2.0)
    np.testing.assert_allclose(t.weights, [g, g, 0, g, 1.08**0.5, 1.08**0.5, 0], rtol=1e-5)
    t = _weights("geometric", "truncate", cap=1.2)
    np.testing.assert_allclose(t.weights, [1.2, 1.2, 0, 1.2, 1.08**0.5, 1.08**0.5, 0],
                               rtol=1e-5)
    m = _weights("geometric", "mask", cap=1.2)
    np.testing.assert_allclose(m.weights, [0, 0, 0, 0, 1.08**0.5, 1.08**0.5, 0], rtol=1e-5)


@pytest.mark.parametrize("level", TIS_LEVELS)
@pytest.mark.parametrize("mode", TIS_MODES)
def test_huge_log_ratios_stay_finite(level, mode):
    # 10 tokens of log ρ = +500 (sequence: +5000) and one sample of −5000 and a +inf/−inf pair.
    mu = np.zeros((3, 10), np.float32)
    old = np.stack([np.full(10, 500.0), np.full(10, -500.0),
                    np.array([np.inf, -np.inf] + [0.0] * 8)]).astype(np.float32)
    t = importance_weights(old, mu, np.ones((3, 10)), level=level, mode=mode, cap=3.0)
    w = np.asarray(t.weights)
    assert np.all(np.isfinite(w)) and np.all(w >= 0) and np.all(w <= 3.0 * (1 + 1e-6))
    np.testing.assert_allclose(w[0], 3.0 if mode == "truncate" else 0.0, rtol=1e-6)
    assert np.all(np.asarray(t.capped)[0])
    assert np.all(w[1] < 1e-30)


@pytest.mark.parametrize("level", TIS_LEVELS)
def test_packing_does_not_change_the_weights(level):
    # The same two samples as one row, as two rows, and one by one (segment_ids=None).
    rng = np.random.default_rng(0)
    lengths = (5, 3)
    old = [rng.normal(size=n).astype(np.float32) for n in lengths]
    mu = [o + rng.normal(size=o.size).astype(np.float32) * 0.5 for o in old]
    masks = [np.array([0, 1, 1, 1, 1]), np.array([1, 1, 0])]
    one = importance_weights(np.concatenate(old), np.concatenate(mu), np.concatenate(masks),
                             np.repeat([1, 2], lengths), level=level, cap=1.5).weights
    rows = importance_weights(
        np.stack([old[0], np.pad(old[1], (0, 2))]), np.stack([mu[0], np.pad(mu[1], (0, 2))]),
        np.stack([masks[0], np.pad(masks[1], (0, 2))]),
        np.array([[1] * 5, [1, 1, 1, 0, 0]]), level=level, cap=1.5).weights
    single = [importance_weights(o, m, k, level=level, cap=1.5).weights
              for o, m, k in zip(old, mu, masks, strict=True)]
    np.testing.assert_allclose(one, np.concatenate(single), rtol=1e-6)
    np.testing.assert_allclose(rows[0], single[0], rtol=1e-6)
    np.testing.assert_allclose(rows[1, :3], single[1], rtol=1e-6)


def test_metrics():
    t = _weights("token", "truncate")
    metrics = tis_metrics(t, MASK)
    assert metrics["off_policy/tis_weight_mean"] == pytest.approx((2 + 0.5 + 1.5 + 1.2 + 0.9) / 5)
    assert metrics["off_policy/tis_weight_max"] == pytest.approx(2.0)
    assert metrics["off_policy/tis_capped_frac"] == pytest.approx(1 / 5)
    per_sample = [importance_weights(o, m, k, cap=2.0) for o, m, k in
                  ((OLD[:4], MU[:4], MASK[:4]), (OLD[4:6], MU[4:6], MASK[4:6]))]
    assert tis_metrics(per_sample, [MASK[:4], MASK[4:6]]) == pytest.approx(metrics)
    assert tis_metrics([], [])["off_policy/tis_capped_frac"] == 0.0


def test_rejects_unknown_names():
    x = np.zeros(3)
    with pytest.raises(ValueError, match="tis_level"):
        importance_weights(x, x, x, level="turn")
    with pytest.raises(ValueError, match="tis_mode"):
        importance_weights(x, x, x, mode="clip")
