"""The skip rule of segment-aware attention: which (query block, key block) pairs of a
packed row hold at least one attended (query, key).

Query t attends to key s iff s ≤ t, seg[s] = seg[t] and seg[t] ≠ 0. For each block let
[min, max] be the range of its nonzero ids (a block of pure padding is empty). Query block i
needs key block j iff

    j·block_k ≤ (i+1)·block_q − 1        (its first key is not after its last query)
    and both blocks are nonempty and [min_i, max_i] ∩ [min_j, max_j] ≠ ∅.

Two tokens with equal nonzero ids lie in blocks whose intervals both hold that id, so every
attended pair lies in a needed block pair: skipping the others is exact for any ids. For
packed rows (contiguous runs of increasing ids) the needed pairs are exactly the attended
ones; for arbitrary ids they are a superset, and each kernel's in-pair mask keeps the result
exact.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np

from pallas_kernels._shapes import round_up

_I32_MAX = np.iinfo(np.int32).max


def _block_id_range(seg, block: int):
    """Per block of ``seg [B, Tp]``: (min nonzero id, max id, has a nonzero id)."""
    rows, length = seg.shape
    ids = seg.reshape(rows, length // block, block)
    nonzero = ids != 0
    lo = jnp.min(jnp.where(nonzero, ids, _I32_MAX), axis=-1)
    hi = jnp.max(jnp.where(nonzero, ids, 0), axis=-1)
    return lo, hi, jnp.any(nonzero, axis=-1)


def needed_block_pairs(seg, block_q: int, block_k: int | None = None) -> jax.Array:
    """``[B, nq, nk]`` bool: the pairs of the skip rule for ``seg [B, Tp]`` int32 (Tp a
    multiple of both blocks; ``block_k`` defaults to ``block_q``)."""
    block_k = block_k or block_q
    q_lo, q_hi, q_any = _block_id_range(seg, block_q)
    k_lo, k_hi, k_any = _block_id_range(seg, block_k)
    i = jnp.arange(q_lo.shape[1])[:, None]
    j = jnp.arange(k_lo.shape[1])[None, :]
    causal = j * block_k <= (i + 1) * block_q - 1
    overlap = (q_lo[:, :, None] <= k_hi[:, None, :]) & (k_lo[:, None, :] <= q_hi[:, :, None])
    return causal[None] & q_any[:, :, None] & k_any[:, None, :] & overlap


def pair_mask(q_start, q_seg, k_start, k_seg) -> jax.Array:
    """``[bq, bk]`` bool inside one computed block pair: query at ``q_start + a`` (id
    ``q_seg[a]``) attends to key at ``k_start + c`` iff causal, same id, query not padding.
    Plain ``lax`` ops, so Pallas kernel bodies and plain-JAX loops share it."""
    q_pos = q_start + jax.lax.broadcasted_iota(jnp.int32, (q_seg.shape[0], 1), 0)
    k_pos = k_start + jax.lax.broadcasted_iota(jnp.int32, (1, k_seg.shape[0]), 1)
    q_seg = q_seg[:, None]
    return (k_pos <= q_pos) & (q_seg == k_seg[None, :]) & (q_seg != 0)


def pad_to_blocks(x, block: int):
    """``x [B, T, ...]`` with T padded (zeros: segment id 0) to a multiple of ``block``."""
    extra = round_up(x.shape[1], block) - x.shape[1]
    return x if extra == 0 else jnp.pad(x, ((0, 0), (0, extra)) + ((0, 0),) * (x.ndim - 2))
