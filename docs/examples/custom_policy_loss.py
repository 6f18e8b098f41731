"""FrozenLake with a policy loss of its own: tapered off-policy REINFORCE (TOPR).

    python -m jaxrl_agentic.train --config docs/examples/custom_policy_loss.py

TOPR (Le Roux et al. 2025) keeps REINFORCE's update for positive advantages and tapers the
negative ones by the ratio, so that pushing down a token the policy already avoids costs
little:

    pg_t = −A_t·logp_t                    A_t ≥ 0
    pg_t = −sg(clip(r_t, 0, 1))·A_t·logp_t  A_t < 0,     r_t = exp(logp_t − old_t)

Registering the name is all it takes: the learner looks `policy_loss` up in the registry.
"""

import os

import jax.numpy as jnp
from jax import lax

from jaxrl_agentic.algos.policy_losses import register_policy_loss
from jaxrl_agentic.config import recipe_config
from pallas_kernels import PPOLossSums


def tapered_reinforce(logprobs, old_logprobs, advantages, loss_weights, ref_logprobs, *,
                      clip_low, clip_high, dual_clip, kl_estimator, segment_ids, impl):
    """Weighted sums over [N] loss positions (see algos/policy_losses.py for the contract);
    TOPR has no clip range, so clip_low/clip_high/dual_clip are not read."""
    w = lax.stop_gradient(loss_weights.astype(jnp.float32))
    active = w != 0
    logp = jnp.where(active, logprobs.astype(jnp.float32), 0.0)
    adv = jnp.where(active, lax.stop_gradient(advantages.astype(jnp.float32)), 0.0)
    log_ratio = jnp.clip(jnp.where(active, logp - lax.stop_gradient(old_logprobs), 0.0),
                         -20.0, 20.0)
    ratio = jnp.exp(log_ratio)
    weight = jnp.where(adv >= 0, 1.0, jnp.minimum(ratio, 1.0))
    pg = -lax.stop_gradient(weight) * adv * logp
    kl = jnp.zeros((), jnp.float32)
    if ref_logprobs is not None:  # k1 to the reference, as the built-in losses' "k1"
        kl = jnp.sum(w * jnp.where(active, logp - lax.stop_gradient(ref_logprobs), 0.0))
    counted = (w > 0).astype(jnp.float32)
    tapered = counted * ((adv < 0) & (ratio < 1.0))
    zero = jnp.zeros((), jnp.float32)
    return PPOLossSums(
        pg_loss=jnp.sum(w * pg), kl=kl, clipfrac=lax.stop_gradient(jnp.sum(tapered)),
        dual_clipfrac=zero, ratio=lax.stop_gradient(jnp.sum(counted * ratio)),
        approx_kl=lax.stop_gradient(jnp.sum(counted * -log_ratio)),
        clipfrac_low=lax.stop_gradient(jnp.sum(tapered)), clipfrac_high=zero)


# replace=True: a config file may be loaded more than once in a process.
register_policy_loss("tapered_reinforce", tapered_reinforce, replace=True)


def get_config():
    c = recipe_config(os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "..",
                                   "configs", "frozen_lake.py"))
    c.exp_name = "frozen_lake_topr"
    c.policy_loss = "tapered_reinforce"
    c.init_kl_coef = 0.0  # k1 only in this loss; the recipe's k3 penalty is switched off
    return c
