"""The skip rule of segment-aware attention: which (query block, key block) pairs of a
packed row hold at least one attended (query, key).

Query t attends to key s iff s ≤ t, seg[t] ≠ 0 and seg[s] = seg[t]. With shared prefixes
(tree packing, ``pre [B, T]``: the id of the segment whose tokens query t also sees, 0 for
none) the last condition widens to

    seg[s] = seg[t]   or   (pre[t] ≠ 0 and seg[s] = pre[t]),

so a group's continuations each read the one copy of their common prompt and nothing of each
other. For each block let [min, max] be the range of its nonzero ids (a block of pure
padding is empty), and for a query block also [pmin, pmax], the range of its nonzero prefix
ids. Query block i needs key block j iff

    j·block_k ≤ (i+1)·block_q − 1        (its first key is not after its last query)
    and both blocks are nonempty
    and ([min_i, max_i] ∩ [min_j, max_j] ≠ ∅  or  [pmin_i, pmax_i] ∩ [min_j, max_j] ≠ ∅).

Two tokens with equal nonzero ids (or a query's prefix id equal to a key's id) lie in blocks
whose intervals both hold that id, so every attended pair lies in a needed block pair:
skipping the others is exact for any ids. For packed rows (contiguous runs of increasing
ids) the needed pairs are exactly the attended ones; for arbitrary ids they are a superset,
and each kernel's in-pair mask keeps the result exact.
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


def _overlap(q_lo, q_hi, k_lo, k_hi):
    """``[B, nq, nk]``: query block i's id interval meets key block j's."""
    return (q_lo[:, :, None] <= k_hi[:, None, :]) & (k_lo[:, None, :] <= q_hi[:, :, None])


def needed_block_pairs(seg, block_q: int, block_k: int | None = None, prefix=None, *,
                       parts: bool = False):
    """``[B, nq, nk]`` bool: the pairs of the skip rule for ``seg [B, Tp]`` int32 (Tp a
    multiple of both blocks; ``block_k`` defaults to ``block_q``) and the optional prefix
    ids ``prefix [B, Tp]``. ``parts=True`` gives (own, via prefix) apart: the pairs needed
    for same-segment keys and those needed for the query's prefix keys (their union is the
    rule; a kernel may walk them as two ranges)."""
    block_k = block_k or block_q
    q_lo, q_hi, q_any = _block_id_range(seg, block_q)
    k_lo, k_hi, k_any = _block_id_range(seg, block_k)
    i = jnp.arange(q_lo.shape[1])[:, None]
    j = jnp.arange(k_lo.shape[1])[None, :]
    live = ((j * block_k <= (i + 1) * block_q - 1)[None]
            & q_any[:, :, None] & k_any[:, None, :])
    own = live & _overlap(q_lo, q_hi, k_lo, k_hi)
    if prefix is None:
        return (own, jnp.zeros_like(own)) if parts else own
    p_lo, p_hi, p_any = _block_id_range(prefix, block_q)
    via = live & p_any[:, :, None] & _overlap(p_lo, p_hi, k_lo, k_hi)
    return (own, via) if parts else own | via


def pair_mask(q_start, q_seg, k_start, k_seg, q_prefix=None) -> jax.Array:
    """``[bq, bk]`` bool inside one computed block pair: query at ``q_start + a`` (id
    ``q_seg[a]``, prefix id ``q_prefix[a]`` or none) attends to key at ``k_start + c`` iff
    causal, the query is not padding, and the key's id is the query's or its prefix's.
    Plain ``lax`` ops, so Pallas kernel bodies and plain-JAX loops share it."""
    q_pos = q_start + jax.lax.broadcasted_iota(jnp.int32, (q_seg.shape[0], 1), 0)
    k_pos = k_start + jax.lax.broadcasted_iota(jnp.int32, (1, k_seg.shape[0]), 1)
    k_seg = k_seg[None, :]
    q_seg = q_seg[:, None]
    same = q_seg == k_seg
    if q_prefix is not None:  # a prefix id of 0 matches nothing: keys of id 0 are padding
        q_prefix = q_prefix[:, None]
        same = same | ((q_prefix == k_seg) & (q_prefix != 0))
    return (k_pos <= q_pos) & same & (q_seg != 0)


def pad_to_blocks(x, block: int):
    """``x [B, T, ...]`` with T padded (zeros: segment id 0) to a multiple of ``block``."""
    extra = round_up(x.shape[1], block) - x.shape[1]
    return x if extra == 0 else jnp.pad(x, ((0, 0), (0, extra)) + ((0, 0),) * (x.ndim - 2))
