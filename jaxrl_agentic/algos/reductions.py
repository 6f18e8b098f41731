"""Loss reductions as (weighted sum, denominator), divided once per optimizer update.

A mini-batch is processed as several micro-batches whose gradients are accumulated. The
mean must be taken over the *whole mini-batch*: with per-token losses ``ℓ``, each reduction
is written as

    loss = Σ_micro Σ_t w_t · ℓ_t  /  Σ_micro D_micro

where the weights ``w`` and the denominator ``D`` of a micro-batch depend only on that
micro-batch's tokens. Dividing inside each micro-batch and averaging the quotients (the
bug peers shipped) weights a token by ``1 / tokens in its micro-batch`` instead of
``1 / tokens in the mini-batch``, which depends on how the packer happened to fill rows.

Reductions (segments = samples, identified per row by ``segment_ids > 0``):

* ``token_mean``:          ``w = m``,         ``D = Σ m``
  — every loss token counts equally.
* ``seq_mean_token_sum``:  ``w = m``,         ``D = #{segments with ≥ 1 loss token}``
  — mean over samples of each sample's summed token loss.
* ``seq_mean_token_mean``: ``w = m / n_seg``, ``D = #{segments with ≥ 1 loss token}``
  — mean over samples of each sample's mean token loss; ``n_seg`` = loss tokens of the
  token's own segment.
* ``seq_mean_token_sum_norm``: ``w = m / L``, ``D = #{segments with ≥ 1 loss token}``
  — Dr. GRPO (Liu et al. 2025, "Understanding R1-Zero-Like Training"): each sample's token
  sum divided by one fixed constant ``L = loss_norm_length`` (the generation budget), then
  the mean over samples: ``loss = (1/n) Σ_i Σ_t m·ℓ / L``. Unlike ``/ n_seg`` it gives a long
  and a short reply the same per-token weight, so the length bias of the per-sample mean is
  gone; unlike ``token_mean`` the scale does not depend on how long this batch's replies
  are. (verl's ``seq-mean-token-sum-norm`` divides the summed micro-batch loss by the padded
  width ``loss_mask.shape[-1]`` and not by the sample count, so its scale changes with the
  batch layout; here both factors are fixed per sample, exact under any packing.)

``m`` is the loss mask restricted to non-padding tokens. Per-segment quantities are exact
only if a segment lies entirely in one micro-batch row, which the packer guarantees.
Segments with no loss token (fully masked, e.g. truncated to their prompt) have zero weight
and are not counted in ``D``.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

REDUCTIONS = ("token_mean", "seq_mean_token_sum", "seq_mean_token_mean",
              "seq_mean_token_sum_norm")


def _check(reduction: str, loss_norm_length: float | None = None) -> None:
    if reduction not in REDUCTIONS:
        raise ValueError(f"unknown loss reduction {reduction!r}; expected one of {REDUCTIONS}")
    if reduction == "seq_mean_token_sum_norm" and not (
        loss_norm_length is not None and loss_norm_length > 0
    ):
        raise ValueError("loss_reduction='seq_mean_token_sum_norm' needs loss_norm_length > 0 "
                         f"(the fixed per-sample normaliser), got {loss_norm_length!r}")


def _as_rows(loss_mask: jax.Array, segment_ids: jax.Array) -> tuple[jax.Array, jax.Array]:
    """``[T]`` or ``[B, T]`` inputs as ``[B, T]``; the mask is zeroed on padding tokens."""
    segment_ids = jnp.atleast_2d(jnp.asarray(segment_ids)).astype(jnp.int32)
    mask = jnp.atleast_2d(jnp.asarray(loss_mask)).astype(jnp.float32)
    return mask * (segment_ids > 0), segment_ids


def _segment_loss_tokens(mask: jax.Array, segment_ids: jax.Array) -> jax.Array:
    """``[B, T+1]`` loss-token count per (row, segment id); column 0 is padding.

    A segment holds at least one token, so ids are ``<= T`` and ``T + 1`` columns suffice
    without knowing the segment count at trace time. Rows are offset so that segment ``k``
    of row ``b`` and of row ``b'`` are different segments.
    """
    rows, width = segment_ids.shape
    flat_ids = (segment_ids + jnp.arange(rows)[:, None] * (width + 1)).reshape(-1)
    counts = jax.ops.segment_sum(mask.reshape(-1), flat_ids, num_segments=rows * (width + 1))
    return counts.reshape(rows, width + 1)


def loss_weights(loss_mask: jax.Array, segment_ids: jax.Array, reduction: str, *,
                 loss_norm_length: float | None = None) -> jax.Array:
    """Per-token weights ``w`` (same shape as ``loss_mask``) for ``Σ w·ℓ``; see module doc.

    ``loss_norm_length`` (L, a Python number) is needed by ``seq_mean_token_sum_norm`` only.
    """
    _check(reduction, loss_norm_length)
    mask, ids = _as_rows(loss_mask, segment_ids)
    if reduction == "seq_mean_token_mean":
        per_token_count = jnp.take_along_axis(_segment_loss_tokens(mask, ids), ids, axis=1)
        mask = jnp.where(mask > 0, mask / jnp.maximum(per_token_count, 1.0), 0.0)
    elif reduction == "seq_mean_token_sum_norm":
        mask = mask / jnp.float32(loss_norm_length)
    return mask.reshape(jnp.shape(loss_mask))


def loss_denominator(loss_mask: jax.Array, segment_ids: jax.Array, reduction: str) -> jax.Array:
    """Scalar ``D`` of this (micro-)batch; sum it over micro-batches, divide once.

    (``seq_mean_token_sum_norm`` counts samples like the other ``seq_mean_*``; its constant
    L sits in the weights.)
    """
    _check(reduction, loss_norm_length=1.0)
    mask, ids = _as_rows(loss_mask, segment_ids)
    if reduction == "token_mean":
        return mask.sum()
    counts = _segment_loss_tokens(mask, ids)[:, 1:]
    return (counts > 0).sum().astype(jnp.float32)


def loss_sum_and_denominator(
    per_token_loss: jax.Array, loss_mask: jax.Array, segment_ids: jax.Array, reduction: str,
    *, loss_norm_length: float | None = None,
) -> tuple[jax.Array, jax.Array]:
    """``(Σ w·ℓ, D)`` of one micro-batch — the pair to accumulate (Tunix style)."""
    weights = loss_weights(loss_mask, segment_ids, reduction, loss_norm_length=loss_norm_length)
    # where, not a product: a masked token's loss may be inf/NaN (e.g. exp of a garbage ratio)
    total = jnp.where(weights > 0, weights * per_token_loss, 0.0).sum()
    return total, loss_denominator(loss_mask, segment_ids, reduction)


def finalize_loss(loss_sum: jax.Array, denominator: jax.Array) -> jax.Array:
    """``loss_sum / max(D, 1)``: the one division per update; an all-masked batch gives 0."""
    return loss_sum / jnp.maximum(denominator, 1.0)
