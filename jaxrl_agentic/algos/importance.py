"""Truncated importance sampling (TIS) between the behaviour policy μ and the old policy.

The sampler (behaviour policy μ: other numerics, maybe stale weights) and the learner's
recomputed old policy π_old disagree slightly; the policy gradient estimated on μ's samples
is corrected by importance weights of ``ρ_t = π_old(y_t) / μ(y_t)``, capped at ``C`` so one
unlikely token cannot dominate the batch. With ``log ρ_t = log π_old(y_t) − log μ(y_t)`` over
the loss tokens ``t ∈ i`` of sample ``i`` (``n_i`` of them):

    level="token":      log w_t = log ρ_t
    level="sequence":   log w_t = Σ_{u ∈ i} log ρ_u              (the whole reply's ratio)
    level="geometric":  log w_t = (1/n_i) Σ_{u ∈ i} log ρ_u      (its per-token geometric mean)

    mode="truncate":    w_t = exp(min(log w_t, log C))  = min(ρ, C)
    mode="mask":        w_t = exp(log w_t) if log c ≤ log w_t ≤ log C else 0   (drop token /
                        sample outside the band; c = ``lower_cap``, default 1/C as verl's)

Everything stays in log space and ``min`` comes before ``exp``, so a sequence log-ratio of
+5000 gives ``C`` (truncate) or 0 (mask), never inf/NaN. Per-token log-ratios are clamped to
``±LOG_RATIO_LIMIT`` first so that ±inf inputs cannot meet in a sum as ``inf − inf``.
Token level is the per-token weight verl calls TIS; sequence and geometric are the
sample-level weights of its "rollout importance sampling" (geometric is the length-normalised
one, whose value does not shrink or explode with reply length).

The weights carry no gradient (μ and π_old are data) and are ≥ 0, so the learner can fold
them into the advantages: for PPO's ``max(−A·r, −A·clip(r))`` (and the dual clip) and for
GSPO/CISPO, ``w·loss(A) = loss(w·A)``.

Shapes: ``[T]`` or ``[B, T]``. ``segment_ids`` (0 = padding, 1.. = samples, restarting per
row) say which sample a token belongs to; ``None`` means every row is one sample, which is
how the host calls it on one sample's 1-D arrays.
"""

from __future__ import annotations

from typing import NamedTuple

import jax
import jax.numpy as jnp
import numpy as np

TIS_LEVELS = ("token", "sequence", "geometric")
TIS_MODES = ("truncate", "mask")
# Far beyond any meaningful ratio (exp(1e4) is inf in fp32 long before), small enough that a
# sum over a million tokens stays finite in fp32.
LOG_RATIO_LIMIT = 1e4


class TISWeights(NamedTuple):
    """``weights``: fp32 w_t on loss tokens, 0 elsewhere. ``capped``: bool, the loss tokens
    whose ratio exceeded C (truncated to C) or left the band (masked to 0)."""

    weights: jax.Array
    capped: jax.Array


def _per_sample_sum(values: jax.Array, segment_ids: jax.Array) -> jax.Array:
    """``[B, T]``: each token gets the sum of ``values`` over its (row, segment)."""
    rows, width = segment_ids.shape
    flat = (segment_ids + jnp.arange(rows)[:, None] * (width + 1)).reshape(-1)
    sums = jax.ops.segment_sum(values.reshape(-1), flat, num_segments=rows * (width + 1))
    return sums[flat].reshape(rows, width)


def importance_weights(
    old_logprobs: jax.Array,
    behaviour_logprobs: jax.Array,
    loss_mask: jax.Array,
    segment_ids: jax.Array | None = None,
    *,
    level: str = "token",
    mode: str = "truncate",
    cap: float = 2.0,
    lower_cap: float | None = None,
) -> TISWeights:
    """TIS weights (module doc) of ``ρ = π_old / μ`` for ``level`` and ``mode``, cap ``C``
    (and, in mask mode, lower bound ``lower_cap``, default ``1/C``).

    ``old_logprobs`` = log π_old (the learner's recomputation), ``behaviour_logprobs`` =
    log μ (the sampler's). Non-loss tokens (``loss_mask == 0`` or padding) may hold garbage;
    they get weight 0 and do not enter the sample sums.
    """
    if level not in TIS_LEVELS:
        raise ValueError(f"unknown tis_level {level!r}; expected one of {TIS_LEVELS}")
    if mode not in TIS_MODES:
        raise ValueError(f"unknown tis_mode {mode!r}; expected one of {TIS_MODES}")
    if not cap > 0:
        raise ValueError(f"the TIS cap must be > 0, got {cap}")
    lower_cap = 1.0 / cap if lower_cap is None else float(lower_cap)
    if not 0 < lower_cap <= cap:
        raise ValueError(f"the TIS lower cap must lie in (0, cap={cap}], got {lower_cap}")
    shape = jnp.shape(loss_mask)
    mask = jnp.atleast_2d(jnp.asarray(loss_mask)) > 0
    if segment_ids is None:
        ids = jnp.ones(mask.shape, jnp.int32)
    else:
        ids = jnp.atleast_2d(jnp.asarray(segment_ids)).astype(jnp.int32)
    mask = mask & (ids > 0)
    old = jnp.atleast_2d(jnp.asarray(old_logprobs, jnp.float32))
    mu = jnp.atleast_2d(jnp.asarray(behaviour_logprobs, jnp.float32))
    log_rho = jnp.where(mask, jnp.clip(old - mu, -LOG_RATIO_LIMIT, LOG_RATIO_LIMIT), 0.0)
    if level == "token":
        log_w = log_rho
    else:
        log_w = _per_sample_sum(log_rho, ids)
        if level == "geometric":
            log_w = log_w / jnp.maximum(_per_sample_sum(mask.astype(jnp.float32), ids), 1.0)
    log_cap = jnp.log(jnp.float32(cap))
    capped = mask & (log_w > log_cap)
    if mode == "mask":
        capped = capped | (mask & (log_w < jnp.log(jnp.float32(lower_cap))))
    if mode == "truncate":
        weights = jnp.exp(jnp.minimum(log_w, log_cap))
    else:
        weights = jnp.where(capped, 0.0, jnp.exp(jnp.minimum(log_w, log_cap)))
    weights = jnp.where(mask, weights, 0.0)
    return TISWeights(weights.reshape(shape), capped.reshape(shape))


def tis_metrics(tis: TISWeights, loss_mask) -> dict[str, float]:
    """Host metrics over loss tokens: ``off_policy/tis_weight_mean``,
    ``off_policy/tis_weight_max`` and ``off_policy/tis_capped_frac`` (the fraction of loss
    tokens truncated or masked; at sample level every token of a capped sample counts).

    ``tis``/``loss_mask`` may also be lists of per-sample results; an empty set reports the
    neutral values (mean 1, max 1, 0 capped).
    """
    if isinstance(tis, (list, tuple)) and not isinstance(tis, TISWeights):
        masks = [np.asarray(m) > 0 for m in loss_mask]
        w = np.concatenate([np.asarray(t.weights)[m] for t, m in zip(tis, masks, strict=True)]
                           or [np.zeros(0)])
        c = np.concatenate([np.asarray(t.capped)[m] for t, m in zip(tis, masks, strict=True)]
                           or [np.zeros(0, bool)])
    else:
        m = np.asarray(loss_mask) > 0
        w, c = np.asarray(tis.weights)[m], np.asarray(tis.capped)[m]
    if w.size == 0:
        return {"off_policy/tis_weight_mean": 1.0, "off_policy/tis_weight_max": 1.0,
                "off_policy/tis_capped_frac": 0.0}
    return {"off_policy/tis_weight_mean": float(w.mean()),
            "off_policy/tis_weight_max": float(w.max()),
            "off_policy/tis_capped_frac": float(c.mean())}
