"""The policy-loss registry: the built-in names, a loss registered from outside the package,
and the rules that read a loss's registration (bounds, dual clip)."""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxrl_agentic.algos import policy_losses
from jaxrl_agentic.algos.losses import policy_loss
from jaxrl_agentic.algos.policy_losses import (
    get_policy_loss,
    policy_loss_names,
    register_policy_loss,
)
from jaxrl_agentic.training.learner_config import LearnerConfig
from pallas_kernels import PPOLossSums


def test_builtin_losses_and_their_rules():
    assert {"ppo", "gspo", "cispo"} <= set(policy_loss_names())
    assert get_policy_loss("ppo").allows_dual_clip and not get_policy_loss("gspo").allows_dual_clip
    assert LearnerConfig(policy_loss="cispo", cispo_clip_low=1.0,
                         cispo_clip_high=5.0).ratio_bounds == (1.0, 5.0)
    assert LearnerConfig(policy_loss="gspo", pg_clip=3e-4).ratio_bounds == (3e-4, None)
    with pytest.raises(ValueError, match="policy_loss: choose one of ppo, gspo, cispo"):
        LearnerConfig(policy_loss="grpo")
    with pytest.raises(ValueError, match="dual_clip: bounds PPO's token loss"):
        LearnerConfig(policy_loss="cispo", dual_clip=3.0)


def plain_policy_gradient(logprobs, old_logprobs, advantages, loss_weights, ref_logprobs, *,
                          clip_low, clip_high, dual_clip, kl_estimator, segment_ids, impl,
                          scale):
    """REINFORCE on the learner's logprobs: pg_t = −scale·A_t·logp_t, no ratio at all."""
    zero = jnp.zeros((), jnp.float32)
    pg = jnp.sum(loss_weights * -scale * advantages * logprobs)
    counted = jnp.sum(loss_weights > 0).astype(jnp.float32)
    return PPOLossSums(pg_loss=pg, kl=zero, clipfrac=zero, dual_clipfrac=zero, ratio=counted,
                       approx_kl=zero, clipfrac_low=zero, clipfrac_high=zero)


def test_a_loss_registered_from_outside_is_used_by_name():
    name = "test_plain_pg"
    register_policy_loss(name, functools.partial(plain_policy_gradient, scale=2.0))
    try:
        with pytest.raises(ValueError, match="already registered"):
            register_policy_loss(name, plain_policy_gradient)
        assert LearnerConfig(policy_loss=name).policy_loss == name  # valid in the config
        rng = np.random.default_rng(0)
        hidden = jnp.asarray(rng.normal(size=(3, 8)), jnp.float32)
        head = jnp.asarray(rng.normal(size=(8, 16)), jnp.float32)
        targets = jnp.asarray([1, 5, 7])
        adv, w = jnp.asarray([1.0, -2.0, 0.5]), jnp.asarray([1.0, 1.0, 0.0])
        sums = policy_loss(hidden, head, targets, jnp.zeros(3), adv, w, policy_loss=name)
        logp = np.asarray(jax.nn.log_softmax(hidden @ head))[np.arange(3), [1, 5, 7]]
        np.testing.assert_allclose(float(sums.pg_loss), -2.0 * (logp[0] - 2.0 * logp[1]), atol=1e-5)
    finally:
        policy_losses._LOSSES.pop(name)

