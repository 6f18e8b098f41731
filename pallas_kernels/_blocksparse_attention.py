"""Segment-aware causal attention for CPU (plain JAX): only the block pairs a row needs.

A packed row of length T holds several sequences told apart by segment ids (0 = padding).
Query t attends to key s iff s ≤ t, seg[s] = seg[t] and seg[t] ≠ 0 (or, with tree packing's
prefix ids, seg[s] = pre[t] ≠ 0: ``_segment_blocks``). Cut the row into blocks
of ``block`` tokens; only the (query block, key block) pairs of the skip rule
(``_segment_blocks``: causal and overlapping id ranges) are computed. The dense path computes
T² pairs (T²/2 block-causal); a row of segments of lengths Lₙ needs about
Σ Lₙ²/2 + T·block/2 of them.

Shapes stay static: the pair list of each row is the needed entries of its [nb, nb] block
matrix (``jnp.nonzero`` with size nb(nb+1)/2, the causal count), and a loop with a
*dynamic* trip count (max over rows of the needed count) walks it, one pair of every row
per iteration. The forward is FlashAttention's online softmax per query block
(``_online_softmax``, the update the sampler's cached attention runs too):

    s = q_i·k_jᵀ/√H (masked),  m' = max(m, max s),  α = e^{m−m'},
    l' = α·l + Σ e^{s−m'},     acc' = α·acc + e^{s−m'}·v_j,     out = acc/l,  lse = m + log l

A dynamic trip count has no autodiff, so the backward is written out (FlashAttention-2),
recomputing each needed pair from (q, k, v, out, lse):

    P = e^{s − lse},  D = rowsum(dO ∘ O),  dS = P ∘ (dO·v_jᵀ − D),
    dv_j += Pᵀ·dO_i,  dq_i += dS·k_j/√H,  dk_j += dSᵀ·q_i/√H

Only q, k, v, the output and lse are kept for the backward, never a [T, T] score matrix.
Queries of padding (id 0) attend to nothing: output 0 and no gradient. Matmul inputs stay
in the input dtype with float32 accumulation; softmax statistics are float32.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp

from pallas_kernels import _online_softmax as online_softmax
from pallas_kernels._online_softmax import NEG
from pallas_kernels._same_bits import keeps_same_bits
from pallas_kernels._segment_blocks import needed_block_pairs, pad_to_blocks, pair_mask


def _pair_list(segment_ids: jax.Array, prefix_ids, block: int):
    """Query block, key block [B, P] (P = nb(nb+1)/2, sorted by query block) and the count
    of needed pairs per row [B]; entries past a row's count are (0, 0) and skipped."""
    needed = needed_block_pairs(segment_ids, block, prefix=prefix_ids)
    nb = needed.shape[1]
    flat = needed.reshape(needed.shape[0], nb * nb)
    index = jax.vmap(lambda f: jnp.nonzero(f, size=nb * (nb + 1) // 2, fill_value=0)[0])(flat)
    count = jnp.sum(flat, axis=-1, dtype=jnp.int32)
    return (index // nb).astype(jnp.int32), (index % nb).astype(jnp.int32), count


def _query_blocks(x, block: int, kv_heads: int):
    """[B, T, N, H] → [B, nb, K, G, block, H] (query heads grouped per kv head)."""
    b, t, n, h = x.shape
    x = x.reshape(b, t // block, block, kv_heads, n // kv_heads, h)
    return x.transpose(0, 1, 3, 4, 2, 5)


def _key_blocks(x, block: int):
    """[B, T, K, H] → [B, nb, K, block, H]."""
    b, t, k, h = x.shape
    return x.reshape(b, t // block, block, k, h).transpose(0, 1, 3, 2, 4)


def _from_query_blocks(x, length: int):
    b, nb, k, g, block, h = x.shape
    return x.transpose(0, 1, 4, 2, 3, 5).reshape(b, nb * block, k * g, h)[:, :length]


def _from_key_blocks(x, length: int):
    b, nb, k, block, h = x.shape
    return x.transpose(0, 1, 3, 2, 4).reshape(b, nb * block, k, h)[:, :length]


def _scores(q_blk, k_blk, scale):
    """[K, G, bq, H] · [K, bk, H] → float32 [K, G, bq, bk]."""
    return jnp.einsum("kgqh,ksh->kgqs", q_blk, k_blk, preferred_element_type=jnp.float32) * scale


def _blocked(q, k, v, segment_ids, prefix_ids, block: int):
    """q, k, v in blocks, segment and prefix ids [B, nb, block] (prefix ids None when
    None: the flat layout's program is unchanged) and the softmax scale 1/√H."""
    qb, kb, vb = _query_blocks(q, block, k.shape[2]), _key_blocks(k, block), _key_blocks(v, block)
    seg, pre = (None if x is None else x.reshape(x.shape[0], -1, block)
                for x in (segment_ids, prefix_ids))
    return qb, kb, vb, seg, pre, q.shape[-1] ** -0.5


def _at(ids, i):
    return None if ids is None else ids[i]


def _forward(q, k, v, segment_ids, prefix_ids, pairs, block: int):
    """Blocked inputs → (out [B, nb, K, G, block, H] float32, lse [B, nb, K, G, block])."""
    qb, kb, vb, seg, pre, scale = _blocked(q, k, v, segment_ids, prefix_ids, block)
    q_block, k_block, count = pairs

    def row_pair(p, m, l, acc, qb, kb, vb, seg, pre, q_block, k_block, count):
        i, j = q_block[p], k_block[p]
        mask = pair_mask(i * block, seg[i], j * block, seg[j], _at(pre, i))
        s = jnp.where(mask, _scores(qb[i], kb[j], scale), NEG)
        m_new, l_new, acc_new = online_softmax.update(
            m[i], l[i], acc[i], s, mask, lambda probs: jnp.einsum(
                "kgqs,ksh->kgqh", probs.astype(vb.dtype), vb[j],
                preferred_element_type=jnp.float32), fixed_order=keeps_same_bits(vb.dtype))
        live = p < count  # past this row's count: leave its state as it is
        return (m.at[i].set(jnp.where(live, m_new, m[i])),
                l.at[i].set(jnp.where(live, l_new, l[i])),
                acc.at[i].set(jnp.where(live, acc_new, acc[i])))

    step = jax.vmap(row_pair, in_axes=(None,) + (0,) * 11)
    m, l, acc = jax.lax.fori_loop(
        0, jnp.max(count),
        lambda p, c: step(p, *c, qb, kb, vb, seg, pre, q_block, k_block, count),
        online_softmax.init_state(qb.shape[:-1], qb.shape))
    return online_softmax.finish(m, l, acc)


def _backward(q, k, v, segment_ids, prefix_ids, pairs, out, lse, d_out, block: int):
    qb, kb, vb, seg, pre, scale = _blocked(q, k, v, segment_ids, prefix_ids, block)
    d_outb = _query_blocks(d_out, block, k.shape[2])
    delta = jnp.sum(d_outb.astype(jnp.float32) * _query_blocks(out, block, k.shape[2]), axis=-1)
    q_block, k_block, count = pairs

    def row_pair(p, dq, dk, dv, qb, kb, vb, d_outb, delta, lse, seg, pre, q_block, k_block,
                 count):
        i, j = q_block[p], k_block[p]
        mask = pair_mask(i * block, seg[i], j * block, seg[j], _at(pre, i)) & (p < count)
        probs = jnp.where(mask, jnp.exp(_scores(qb[i], kb[j], scale) - lse[i][..., None]), 0.0)
        dv_j = jnp.einsum("kgqs,kgqh->ksh", probs.astype(d_outb.dtype), d_outb[i],
                          preferred_element_type=jnp.float32)
        dp = jnp.einsum("kgqh,ksh->kgqs", d_outb[i], vb[j], preferred_element_type=jnp.float32)
        ds = (probs * (dp - delta[i][..., None])).astype(qb.dtype)
        dq_i = jnp.einsum("kgqs,ksh->kgqh", ds, kb[j], preferred_element_type=jnp.float32)
        dk_j = jnp.einsum("kgqs,kgqh->ksh", ds, qb[i], preferred_element_type=jnp.float32)
        return dq.at[i].add(dq_i * scale), dk.at[j].add(dk_j * scale), dv.at[j].add(dv_j)

    step = jax.vmap(row_pair, in_axes=(None,) + (0,) * 14)
    grads = tuple(jnp.zeros(x.shape, jnp.float32) for x in (qb, kb, vb))
    dq, dk, dv = jax.lax.fori_loop(
        0, jnp.max(count),
        lambda p, c: step(p, *c, qb, kb, vb, d_outb, delta, lse, seg, pre, q_block, k_block,
                          count),
        grads)
    return dq, dk, dv


@functools.partial(jax.custom_vjp, nondiff_argnums=(5,))
def _attention(q, k, v, segment_ids, prefix_ids, block):
    return _attention_fwd(q, k, v, segment_ids, prefix_ids, block)[0]


def _attention_fwd(q, k, v, segment_ids, prefix_ids, block):
    # The pair list is a residual: the backward walks the same pairs without rebuilding it.
    pairs = _pair_list(segment_ids, prefix_ids, block)
    out, lse = _forward(q, k, v, segment_ids, prefix_ids, pairs, block)
    out = _from_query_blocks(out, q.shape[1]).astype(q.dtype)
    return out, (q, k, v, segment_ids, prefix_ids, pairs, out, lse)


def _attention_bwd(block, residuals, d_out):
    q, k, v, segment_ids, prefix_ids, pairs, out, lse = residuals
    length = q.shape[1]
    dq, dk, dv = _backward(q, k, v, segment_ids, prefix_ids, pairs, out, lse, d_out, block)
    return (_from_query_blocks(dq, length).astype(q.dtype),
            _from_key_blocks(dk, length).astype(k.dtype),
            _from_key_blocks(dv, length).astype(v.dtype), None, None)


_attention.defvjp(_attention_fwd, _attention_bwd)


def blocksparse_segment_attention(q, k, v, segment_ids, prefix_ids=None, *,
                                  block: int = 128) -> jax.Array:
    """q [B, T, N, H], k/v [B, T, K, H] (N a multiple of K), segment_ids [B, T] int
    (0 = padding), optional prefix_ids [B, T] (tree packing; None = none) → [B, T, N, H] in
    q's dtype; T need not be a multiple of `block` (the tail is padded with id 0 and cut off
    again)."""
    length = q.shape[1]
    q, k, v = (pad_to_blocks(x, block) for x in (q, k, v))
    segment_ids = pad_to_blocks(segment_ids.astype(jnp.int32), block)
    if prefix_ids is not None:
        prefix_ids = pad_to_blocks(prefix_ids.astype(jnp.int32), block)
    return _attention(q, k, v, segment_ids, prefix_ids, block)[:, :length]
