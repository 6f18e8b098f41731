"""Policy and value losses as weighted sums, to be divided once per optimizer update.

Every function here returns *sums* over the tokens it is given, weighted by the reduction's
per-token weights ``w`` (``algos/reductions.py``); the learner adds them over micro-batches
and divides once by the mini-batch's global denominator ``D``:

    loss = (Σ_micro objective_sum) / max(Σ_micro D, 1)

Policy objective (per token ``t`` with weight ``w_t``; the losses by name are
``algos/policy_losses.py``'s registry, computed by ``pallas_kernels.ppo_loss``):

    logp_t   = log softmax(h_t·W / τ)[y_t]                       (fused, no [N, V] logits)
    H_t      = −Σ_v p_v log p_v                                 (entropy of the same softmax)
    pg_t     = max(−A_t·r_t, −A_t·clip(r_t, 1−ε_lo, 1+ε_hi)),   r_t = exp(logp_t − old_t)
               (dual clip: min(pg_t, −A_t·c) where A_t < 0)                    policy_loss="ppo"
    pg_t     = same with r_t → s_t = sg(s_i)·π_t/sg(π_t),                           "gspo"
               s_i = exp(mean_{u ∈ i} (logp_u − old_u)) of t's sample (GSPO-token form)
    pg_t     = −sg(clip(r_t, 1−ε_lo, 1+ε_hi))·A_t·logp_t                         "cispo"
    kl_t     = k1 | k2 | k3 of (logp_t − ref_t)                  (``algos/kl.py``)

    objective_sum = Σ w·pg + β·Σ w·kl − c_H·Σ w·H

Value loss (PPO2-style clipping for a GAE critic, per token):

    ℓ_t = ½ · max((V_t − R_t)², (clip(V_t, V_old,t − ε_v, V_old,t + ε_v) − R_t)²)

The clipped branch stops a critic update from moving the prediction more than ``ε_v`` away
from the value the advantages were computed with; taking the max makes it pessimistic.
"""

from __future__ import annotations

from typing import NamedTuple

import jax
import jax.numpy as jnp
from jax import lax

from jaxrl_agentic.algos.policy_losses import get_policy_loss
from jaxrl_agentic.algos.reductions import loss_sum_and_denominator
from pallas_kernels import (
    OUT_OF_SUPPORT_LOGPROB,
    restricted_token_logprobs,
    token_logprobs,
)
from pallas_kernels.token_logprobs import IMPLS as TOKEN_LOGPROB_IMPLS

KERNEL_IMPLS = TOKEN_LOGPROB_IMPLS  # the `kernel_impl` choices
__all__ = ["KERNEL_IMPLS", "PolicyLossSums", "clipped_value_loss",
           "entropy_bonus", "flat_segment_ids", "policy_loss", "ppo_loss_impl", "value_loss"]


class PolicyLossSums(NamedTuple):
    """Scalar fp32 weighted sums of one micro-batch (divide by the global ``D``).

    ``objective = pg_loss + kl_coef·kl − entropy_coef·entropy`` carries the gradient;
    ``clipfrac``, ``dual_clipfrac``, ``ratio``, ``approx_kl``, ``clipfrac_low``,
    ``clipfrac_high`` and ``tokens`` are token *counts* / unweighted sums over tokens with
    ``w > 0`` (divide by ``tokens``; ``clipfrac = clipfrac_low + clipfrac_high``);
    ``teacher``: ``Σ w·D_t`` of a distillation teacher's divergence
    (``algos/teacher_divergence.py``; 0 here, the learner adds it). Each field is logged as
    ``actor/<field>``: one name from the sums to the log.
    """

    objective: jax.Array
    pg_loss: jax.Array
    kl: jax.Array
    entropy: jax.Array
    clipfrac: jax.Array
    dual_clipfrac: jax.Array
    ratio: jax.Array
    approx_kl: jax.Array
    tokens: jax.Array
    clipfrac_low: jax.Array
    clipfrac_high: jax.Array
    teacher: jax.Array


def ppo_loss_impl(kernel_impl: str) -> str:
    """The ``masked_ppo_loss`` impl paired with a ``token_logprobs`` impl.

    The PPO loss has no "chunked" variant (it is elementwise; there is nothing to chunk), so
    "chunked" pairs with the jnp reference.
    """
    if kernel_impl not in KERNEL_IMPLS:
        raise ValueError(f"unknown kernel_impl {kernel_impl!r}; expected one of {KERNEL_IMPLS}")
    return "reference" if kernel_impl == "chunked" else kernel_impl


def flat_segment_ids(segment_ids: jax.Array) -> jax.Array:
    """``[B, T]`` per-row segment ids → ``[B·T]`` ids that are distinct across rows.

    ``id + b·(T + 1)`` on row ``b`` (padding stays 0): the packer restarts ids at 1 on every
    row, so once flattened, the last sample of a full row and the first of the next could
    share an id and be read as one sample. ``[T]`` input is returned unchanged.
    """
    ids = jnp.asarray(segment_ids).astype(jnp.int32)
    if ids.ndim == 1:
        return ids
    rows, width = ids.shape
    offset = jnp.arange(rows, dtype=jnp.int32)[:, None] * (width + 1)
    return jnp.where(ids > 0, ids + offset, 0).reshape(rows * width)


def entropy_bonus(entropy: jax.Array, loss_weights: jax.Array) -> jax.Array:
    """``Σ w_t·H_t``: the entropy sum the objective subtracts (times ``entropy_coef``).

    Weighted exactly like the policy term, so ``entropy_sum / D`` is the entropy under the
    same reduction; masked tokens are excluded with ``where`` (their H may be garbage).
    """
    w = jnp.asarray(loss_weights, jnp.float32)
    return jnp.sum(jnp.where(w != 0, w * entropy.astype(jnp.float32), 0.0))


def policy_loss(
    hidden: jax.Array,
    lm_head: jax.Array,
    targets: jax.Array,
    old_logprobs: jax.Array,
    advantages: jax.Array,
    loss_weights: jax.Array,
    ref_logprobs: jax.Array | None = None,
    *,
    temperature: float = 1.0,
    clip_low: float = 0.2,
    clip_high: float | None = None,
    dual_clip: float | None = None,
    kl_coef: jax.Array | float = 0.0,
    kl_estimator: str = "k3",
    entropy_coef: float = 0.0,
    impl: str = "auto",
    policy_loss: str = "ppo",
    segment_ids: jax.Array | None = None,
    top_k: int = 0,
    top_p: float = 1.0,
) -> PolicyLossSums:
    """Token logprobs (+ entropy) → masked policy-loss sums → ``pg + β·kl − c_H·entropy``.

    Args:
      hidden: ``[N, D]`` final-normed hidden states; row ``i`` predicts ``targets[i]``.
      lm_head: ``[D, V]`` output projection.
      targets, old_logprobs, advantages, loss_weights, ref_logprobs: ``[N]`` per predicted
        token (the caller has already aligned them with ``hidden``).
      kl_coef: β; may be a traced array (controller state). Ignored without ``ref_logprobs``.
      entropy_coef: a Python float. When 0 the entropy is still reported but carries no
        gradient, so the fused backward skips its entropy term.
      impl: ``token_logprobs`` implementation; the PPO loss uses :func:`ppo_loss_impl`.
      policy_loss: a registered name (``algos/policy_losses.py``). "gspo" runs the jnp
        reference of the loss whatever ``impl`` (the logprobs keep ``impl``).
      segment_ids: which sample each of the N tokens belongs to (0 = padding), needed by
        "gspo": ``[N]`` with each sample one contiguous run, or the packed ``[B, T]`` ids
        with ``B·T = N`` (flattened here with :func:`flat_segment_ids`). Pass the ids the
        reduction weights were computed with (prediction i lies in token i's segment).
      top_k, top_p: the sampler's support restriction (0 / 1.0 = none). When set, logprob
        and entropy are those of the renormalised distribution the sampler drew from
        (``pallas_kernels.restricted_token_logprobs``, jnp only, whatever ``impl``);
        ``old_logprobs`` must then be restricted logprobs too.
    """
    if top_k > 0 or top_p < 1.0:
        logprobs, entropy = restricted_token_logprobs(
            hidden, lm_head, targets, temperature, top_k=top_k, top_p=top_p,
            return_entropy=True)
        if ref_logprobs is not None:
            # A target the policy now puts outside its kept set has the sentinel, not a
            # logprob: leave it out of the KL (x = 0 gives 0 under k1/k2/k3, and the
            # restricted logprob has no gradient there) instead of reading 1e4 as drift.
            ref_logprobs = jnp.where(logprobs > OUT_OF_SUPPORT_LOGPROB / 2, ref_logprobs,
                                     lax.stop_gradient(logprobs))
    else:
        logprobs, entropy = token_logprobs(
            hidden, lm_head, targets, temperature, return_entropy=True, impl=impl
        )
    if entropy_coef == 0:
        entropy = lax.stop_gradient(entropy)
    sums = get_policy_loss(policy_loss).sums(
        logprobs,
        old_logprobs,
        advantages,
        loss_weights,
        ref_logprobs,
        clip_low=clip_low,
        clip_high=clip_high,
        dual_clip=dual_clip,
        kl_estimator=kl_estimator,
        segment_ids=None if segment_ids is None else flat_segment_ids(segment_ids),
        impl=ppo_loss_impl(impl),
    )
    entropy_sum = entropy_bonus(entropy, loss_weights)
    objective = sums.pg_loss - entropy_coef * entropy_sum
    if ref_logprobs is not None:
        objective = objective + jnp.asarray(kl_coef, jnp.float32) * sums.kl
    return PolicyLossSums(
        objective=objective,
        pg_loss=sums.pg_loss,
        kl=sums.kl,
        entropy=lax.stop_gradient(entropy_sum),
        clipfrac=sums.clipfrac,
        dual_clipfrac=sums.dual_clipfrac,
        ratio=sums.ratio,
        approx_kl=sums.approx_kl,
        tokens=jnp.sum(jnp.asarray(loss_weights) > 0).astype(jnp.float32),
        clipfrac_low=sums.clipfrac_low,
        clipfrac_high=sums.clipfrac_high,
        teacher=jnp.zeros((), jnp.float32),
    )


def clipped_value_loss(
    values: jax.Array, old_values: jax.Array, returns: jax.Array, clip_eps: float | None
) -> jax.Array:
    """Per-token ``½·max((V−R)², (clip(V, V_old ± ε_v) − R)²)``; ``clip_eps=None``: ``½(V−R)²``."""
    values = values.astype(jnp.float32)
    returns = lax.stop_gradient(returns.astype(jnp.float32))
    unclipped = jnp.square(values - returns)
    if clip_eps is None:
        return 0.5 * unclipped
    old_values = lax.stop_gradient(old_values.astype(jnp.float32))
    clipped_values = jnp.clip(values, old_values - clip_eps, old_values + clip_eps)
    return 0.5 * jnp.maximum(unclipped, jnp.square(clipped_values - returns))


def value_loss(
    values: jax.Array,
    old_values: jax.Array,
    returns: jax.Array,
    loss_mask: jax.Array,
    segment_ids: jax.Array,
    reduction: str = "token_mean",
    *,
    clip_eps: float | None = 0.2,
    loss_norm_length: float | None = None,
) -> tuple[jax.Array, jax.Array]:
    """``(Σ w·ℓ, D)`` of the clipped value loss (module doc) under ``reduction``.

    Shapes ``[T]`` or ``[B, T]``; ``values`` are the critic's current predictions,
    ``old_values`` those the advantages were computed with, ``returns`` the GAE targets.
    """
    per_token = clipped_value_loss(values, old_values, returns, clip_eps)
    return loss_sum_and_denominator(per_token, loss_mask, segment_ids, reduction,
                                    loss_norm_length=loss_norm_length)
