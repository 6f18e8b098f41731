"""KL estimators, controllers and reward folding against hand-computed numbers."""

import jax.numpy as jnp
import numpy as np
import pytest

from jaxrl_agentic.algos.kl import (
    adaptive_kl_controller,
    fixed_kl_controller,
    init_kl_controller,
    kl_estimate,
    kl_penalised_rewards,
    update_kl_controller,
)
from pallas_kernels import masked_ppo_loss


def test_estimators_match_their_formulas():
    logp = np.array([-1.0, -2.0, -0.5, -3.0, -0.1], np.float32)
    ref = np.array([-1.5, -2.0, -1.0, -1.0, -0.3], np.float32)
    x = (logp - ref).astype(np.float64)  # [0.5, 0, 0.5, -2, 0.2]
    np.testing.assert_allclose(kl_estimate(logp, ref, "k1"), x, rtol=1e-6)
    np.testing.assert_allclose(kl_estimate(logp, ref, "k2"), 0.5 * x**2, rtol=1e-6)
    np.testing.assert_allclose(kl_estimate(logp, ref, "k3"), np.exp(-x) + x - 1, rtol=1e-5)
    # Hand values: k3(0.5) = e^-0.5 - 0.5 = 0.10653066, k3(-2) = e^2 - 3 = 4.3890561
    np.testing.assert_allclose(
        np.asarray(kl_estimate(logp, ref, "k3"))[[0, 3]], [0.10653066, 4.3890561], rtol=1e-6
    )
    with pytest.raises(ValueError, match="kl_estimator"):
        kl_estimate(logp, ref, "k4")


def test_k1_and_k3_are_unbiased_estimates_of_the_true_kl():
    # Tokens sampled from π: E[k1] = E[k3] = KL(π‖π_ref) exactly; k2 is biased.
    rng = np.random.default_rng(0)
    p = np.array([0.5, 0.3, 0.15, 0.05])
    q = np.array([0.25, 0.25, 0.25, 0.25])
    true_kl = float(np.sum(p * np.log(p / q)))
    tokens = rng.choice(4, size=400_000, p=p)
    logp, ref = np.log(p)[tokens], np.log(q)[tokens]
    for estimator in ("k1", "k3"):
        mean = float(jnp.mean(kl_estimate(logp, ref, estimator)))
        assert abs(mean - true_kl) < 3e-3, (estimator, mean, true_kl)


def test_estimators_agree_with_the_loss_kernel():
    rng = np.random.default_rng(1)
    logp = jnp.asarray(-rng.random(17) * 3, jnp.float32)
    ref = jnp.asarray(-rng.random(17) * 3, jnp.float32)
    w = jnp.asarray(rng.random(17) > 0.3, jnp.float32)
    for estimator in ("k1", "k2", "k3"):
        sums = masked_ppo_loss(
            logp, logp, jnp.zeros(17), w, ref, kl_estimator=estimator, impl="reference"
        )
        expected = float(jnp.sum(w * kl_estimate(logp, ref, estimator)))
        np.testing.assert_allclose(float(sums.kl), expected, rtol=1e-5)


def test_fixed_controller_never_moves():
    state = init_kl_controller(0.05)
    assert not state.adaptive
    for kl in (0.0, 10.0, 1e6):
        state = update_kl_controller(state, kl, n_steps=1000)
    assert float(state.coef) == pytest.approx(0.05)


def test_adaptive_controller_hand_numbers():
    state = adaptive_kl_controller(0.1, target_kl=6.0, horizon=10000)
    # KL 9 → e = clip(9/6 - 1) = clip(0.5) = 0.2; β = 0.1·(1 + 0.2·256/10000) = 0.100512
    state = update_kl_controller(state, 9.0, n_steps=256)
    assert float(state.coef) == pytest.approx(0.100512, rel=1e-6)
    # KL 6.6 → e = 0.1 (inside the clip); β = 0.100512·(1 + 0.1·100/10000) = 0.100612512
    state = update_kl_controller(state, 6.6, n_steps=100)
    assert float(state.coef) == pytest.approx(0.100612512, rel=1e-6)
    # KL 0 → e = -1 clipped to -0.2; β = 0.100612512·(1 - 0.2·1000/10000) = 0.09860026176
    state = update_kl_controller(state, 0.0, n_steps=1000)
    assert float(state.coef) == pytest.approx(0.09860026176, rel=1e-6)
    # KL = target → no change; a NaN observation leaves β alone.
    before = float(state.coef)
    state = update_kl_controller(state, 6.0, n_steps=5000)
    assert float(state.coef) == pytest.approx(before, rel=1e-7)
    state = update_kl_controller(state, float("nan"), n_steps=5000)
    assert float(state.coef) == pytest.approx(before, rel=1e-7)


def test_controller_argument_checks():
    with pytest.raises(ValueError, match="init_kl_coef > 0"):
        adaptive_kl_controller(0.0, target_kl=1.0)
    with pytest.raises(ValueError, match=">= 0"):
        fixed_kl_controller(-0.1)
    assert init_kl_controller(0.2, target_kl=1.0, horizon=50).horizon == 50


def test_kl_penalised_rewards_hand_example():
    rewards = np.array([0.0, 0.0, 1.0])
    logp = np.array([-1.0, -2.0, -0.5])
    ref = np.array([-1.5, -2.0, -1.0])  # x = [0.5, 0, 0.5]
    np.testing.assert_allclose(
        kl_penalised_rewards(rewards, logp, ref, 0.1, "k1"), [-0.05, 0.0, 0.95], rtol=1e-6
    )
    # Only generated tokens are penalised.
    np.testing.assert_allclose(
        kl_penalised_rewards(rewards, logp, ref, 0.1, "k1", loss_mask=[0, 1, 1]),
        [0.0, 0.0, 0.95],
        rtol=1e-6,
    )
    # k2: ½·0.25 = 0.125 → 0.1·0.125 = 0.0125
    np.testing.assert_allclose(
        kl_penalised_rewards(rewards, logp, ref, 0.1, "k2"), [-0.0125, 0.0, 0.9875], rtol=1e-6
    )
