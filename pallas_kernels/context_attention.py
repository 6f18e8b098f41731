"""Segment attention over packed rows whose positions are split over the ``context`` axis.

Under context parallelism (``mesh_axes.CONTEXT_AXIS`` of size C > 1) each device holds
T / C of a row's tokens, so its activations are those of T / C positions. Attention is the
one place where a token needs other devices' tokens. Each query keeps the formula of
``segment_attention`` (causal within its segment, plus tree packing's shared prefix),
written over the tokens' **columns** (their index in the packed row, ``columns [B, T]``)
because the tokens of a split row are not held in column order (below):

    out[t] = Σ_{s ∈ A(t)} softmax_s(q_t·k_sᵀ/√H) · v_s,
    A(t)   = {s : col[s] ≤ col[t], seg[s] = seg[t] ≠ 0 or seg[s] = pre[t] ≠ 0}.

**All-gathered keys and values, not ring attention.** Each device all-gathers the row's
keys, values, segment ids and columns over ``context`` (one collective per layer), runs
its own queries against them, and in the backward all-gathers again and reduce-scatters
the keys' and values' gradients. A ring passes key blocks round the devices in C steps
and overlaps each step's transfer with the previous step's compute, never holding more
than two blocks of keys; the gather holds the whole row's keys [B, T, K, H] for one layer
at a time. With grouped-query attention K/V are a small part of a layer's activations
(K = 2 kv heads of 64 at the tiny model's shape, against the MLP's T/C × F), and the
gather is one collective XLA schedules and overlaps by itself on every backend, written
in a few lines of plain JAX (no hand-written ppermute schedule per platform, no
per-step online-softmax rescaling across devices). Ring attention pays off when T·K·H
of one layer no longer fits beside the rest (rows of 10⁶ tokens); that is not the regime
of agentic rollouts (rows of 8k–128k).

**Zigzag layout (load balance).** Causal attention in column order gives the device with
the row's last tokens C times the work of the first. The learner lays each row out in
``2·C`` chunks of T / (2C) columns and gives device i chunks i and 2C − 1 − i
(:func:`zigzag_order`): each device then has the same number of causal (query, key)
pairs. Every token array is permuted the same way (``training/context_rows.py``), so a
token keeps its segment, position, target and loss weight; the loss is a sum, so nothing
is permuted back.

**Algorithm on each device.** Its queries are taken in pieces of one chunk; a piece
walks the gathered key blocks in column order up to its own last column (a loop with a
dynamic trip count: the causal blocks only) with the online softmax (``_online_softmax``),
and the backward recomputes each block pair from (q, k, v, out, lse) as FlashAttention-2
does (``_blocksparse_attention``'s formulas). Only the device's own q, k, v, output and
lse are kept for the backward: no score matrix and no gathered keys. Inside the computed
blocks segments are masked, not skipped. Plain JAX on every platform.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

from pallas_kernels import _online_softmax as online_softmax
from pallas_kernels._online_softmax import NEG
from pallas_kernels._per_shard import P, batch_spec, head_spec, kernel_mesh
from pallas_kernels.mesh_axes import CONTEXT_AXIS
from pallas_kernels.segment_attention import BLOCK

_F32 = jnp.float32


def context_shards(mesh=None) -> int:
    """The size of ``mesh``'s (default: the context mesh's) context axis; 1 without one."""
    mesh = kernel_mesh() if mesh is None else mesh
    return 1 if mesh is None else dict(mesh.shape).get(CONTEXT_AXIS, 1)


def context_block(length: int, shards: int) -> int:
    """The key block of a row of ``length`` split over ``shards``: ``BLOCK``, or the zigzag
    chunk ``length / (2·shards)`` when that is shorter."""
    return min(BLOCK, length // (2 * shards))


def context_length_error(length: int, shards: int) -> str | None:
    """Why a row of ``length`` cannot be split over ``shards`` (None when it can): each
    device holds two zigzag chunks of whole key blocks."""
    if shards == 1:
        return None
    chunk = length // (2 * shards)
    if chunk < 1 or length % (2 * shards * context_block(length, shards)):
        return (f"a row of {length} tokens cannot be split over context={shards}: it must "
                f"be a multiple of 2·context·block = {2 * shards * min(BLOCK, max(chunk, 1))} "
                f"(two zigzag chunks of whole attention blocks of min({BLOCK}, "
                f"T/(2·context)) per device)")
    return None


def zigzag_order(length: int, shards: int) -> np.ndarray:
    """``[length]`` int32: the column held at each place of a row laid out for ``shards``
    devices. The row is cut into ``2·shards`` chunks and device i (places
    ``[i·T/C, (i+1)·T/C)``) holds chunks i and 2C − 1 − i. Identity for one shard."""
    if shards == 1:
        return np.arange(length, dtype=np.int32)
    chunk = length // (2 * shards)
    order = [c for i in range(shards) for c in (i, 2 * shards - 1 - i)]
    return (np.asarray(order)[:, None] * chunk + np.arange(chunk)[None]).reshape(-1).astype(
        np.int32)


def _mask(q_seg, q_col, q_pre, k_seg, k_col):
    """[B, q, k] bool: the module docstring's A(t) for one piece of queries and one key block."""
    same = q_seg[:, :, None] == k_seg[:, None, :]
    if q_pre is not None:  # a prefix id of 0 matches nothing
        same = same | ((q_pre[:, :, None] == k_seg[:, None, :]) & (q_pre[:, :, None] != 0))
    return same & (k_col[:, None, :] <= q_col[:, :, None]) & (q_seg[:, :, None] != 0)


def _gather(x, axis):
    return x if axis is None else lax.all_gather(x, axis, axis=1, tiled=True)


def _pieces(q, seg, col, pre, piece: int):
    """Per piece of ``piece`` queries: (its slice of the row, its seg, col and pre ids)."""
    for a in range(q.shape[1] // piece):
        cut = slice(a * piece, (a + 1) * piece)
        yield cut, seg[:, cut], col[:, cut], None if pre is None else pre[:, cut]


class _Keys:
    """The gathered keys, values and ids, read one key block (in column order) at a time."""

    def __init__(self, k_all, v_all, k_seg, k_col, block: int):
        self.k, self.v, self.seg, self.col, self.block = k_all, v_all, k_seg, k_col, block
        # Where each column sits in the gathered row: blocks of `block` consecutive columns
        # are contiguous there (chunks are whole blocks), so block j starts at where[j·block].
        self.where = jnp.argsort(k_col[0]).astype(jnp.int32)

    def start(self, j):
        return self.where[j * self.block]

    def read(self, x, at):
        return lax.dynamic_slice_in_dim(x, at, self.block, axis=1)

    def count(self, q_col):
        """Key blocks a piece of queries needs: those up to its last column's."""
        return jnp.max(q_col) // self.block + 1


def _scores(qa, kb, scale):
    return jnp.einsum("bqkgh,bskh->bkgqs", qa, kb, preferred_element_type=_F32) * scale


def _forward(q, keys: _Keys, seg, col, pre, piece: int):
    b, _, n, h = q.shape
    kv_heads = keys.k.shape[2]
    scale = h ** -0.5
    outs, lses = [], []
    for cut, q_seg, q_col, q_pre in _pieces(q, seg, col, pre, piece):
        qa = q[:, cut].reshape(b, piece, kv_heads, n // kv_heads, h)

        def body(j, state, qa=qa, q_seg=q_seg, q_col=q_col, q_pre=q_pre):
            at = keys.start(j)
            kb, vb = keys.read(keys.k, at), keys.read(keys.v, at)
            mask = _mask(q_seg, q_col, q_pre, keys.read(keys.seg, at),
                         keys.read(keys.col, at))[:, None, None]
            s = jnp.where(mask, _scores(qa, kb.astype(qa.dtype), scale), NEG)
            return online_softmax.update(*state, s, mask, lambda p, vb=vb: jnp.einsum(
                "bkgqs,bskh->bkgqh", p.astype(qa.dtype), vb.astype(qa.dtype),
                preferred_element_type=_F32))

        stats = (b, kv_heads, n // kv_heads, piece)
        state = lax.fori_loop(0, keys.count(q_col), body,
                              online_softmax.init_state(stats, stats + (h,)))
        out, lse = online_softmax.finish(*state)
        outs.append(out.transpose(0, 3, 1, 2, 4).reshape(b, piece, n, h))
        lses.append(lse)
    return jnp.concatenate(outs, axis=1), jnp.stack(lses)


def _backward(q, keys: _Keys, seg, col, pre, out, lse, d_out, piece: int):
    b, _, n, h = q.shape
    kv_heads = keys.k.shape[2]
    group, scale = n // kv_heads, h ** -0.5
    d_k = jnp.zeros(keys.k.shape, _F32)
    d_v = jnp.zeros(keys.v.shape, _F32)
    d_qs = []
    for a, (cut, q_seg, q_col, q_pre) in enumerate(_pieces(q, seg, col, pre, piece)):
        def split(x, cut=cut):
            return x[:, cut].reshape(b, piece, kv_heads, group, h)
        qa, do = split(q), split(d_out)
        delta = jnp.sum(do.astype(_F32) * split(out).astype(_F32), axis=-1)
        delta = delta.transpose(0, 2, 3, 1)[..., None]  # [B, K, G, p, 1]
        lse_a = lse[a][..., None]

        def body(j, carry, qa=qa, do=do, delta=delta, lse_a=lse_a, q_seg=q_seg, q_col=q_col,
                 q_pre=q_pre):
            d_q, d_k, d_v = carry
            at = keys.start(j)
            kb = keys.read(keys.k, at).astype(qa.dtype)
            vb = keys.read(keys.v, at).astype(qa.dtype)
            mask = _mask(q_seg, q_col, q_pre, keys.read(keys.seg, at),
                         keys.read(keys.col, at))[:, None, None]
            probs = jnp.where(mask, jnp.exp(_scores(qa, kb, scale) - lse_a), 0.0)
            dv_j = jnp.einsum("bkgqs,bqkgh->bskh", probs.astype(do.dtype), do,
                              preferred_element_type=_F32)
            dp = jnp.einsum("bqkgh,bskh->bkgqs", do, vb, preferred_element_type=_F32)
            ds = (probs * (dp - delta)).astype(qa.dtype)
            d_q = d_q + jnp.einsum("bkgqs,bskh->bqkgh", ds, kb, preferred_element_type=_F32)
            dk_j = jnp.einsum("bkgqs,bqkgh->bskh", ds, qa, preferred_element_type=_F32)

            def add(x, y):
                return lax.dynamic_update_slice_in_dim(x, keys.read(x, at) + y, at, axis=1)

            return d_q, add(d_k, dk_j * scale), add(d_v, dv_j)

        d_q = jnp.zeros(qa.shape, _F32)
        d_q, d_k, d_v = lax.fori_loop(0, keys.count(q_col), body, (d_q, d_k, d_v))
        d_qs.append(d_q.reshape(b, piece, n, h) * scale)
    return jnp.concatenate(d_qs, axis=1), d_k, d_v


@functools.partial(jax.custom_vjp, nondiff_argnums=(6, 7, 8))
def _attention(q, k, v, seg, col, pre, axis, block, piece):
    return _attention_fwd(q, k, v, seg, col, pre, axis, block, piece)[0]


def _gathered(k, v, seg, col, axis, block):
    return _Keys(*(_gather(x, axis) for x in (k, v, seg, col)), block)


def _attention_fwd(q, k, v, seg, col, pre, axis, block, piece):
    out, lse = _forward(q, _gathered(k, v, seg, col, axis, block), seg, col, pre, piece)
    out = out.astype(q.dtype)
    return out, (q, k, v, seg, col, pre, out, lse)


def _attention_bwd(axis, block, piece, residuals, d_out):
    q, k, v, seg, col, pre, out, lse = residuals
    # The keys are gathered again rather than kept: the backward holds one layer's.
    d_q, d_k, d_v = _backward(q, _gathered(k, v, seg, col, axis, block), seg, col, pre,
                              out, lse, d_out, piece)
    if axis is not None:  # every device's share of each key's gradient, summed at its owner
        d_k, d_v = (lax.psum_scatter(x, axis, scatter_dimension=1, tiled=True)
                    for x in (d_k, d_v))
    return d_q.astype(q.dtype), d_k.astype(k.dtype), d_v.astype(v.dtype), None, None, None


_attention.defvjp(_attention_fwd, _attention_bwd)


def context_segment_attention(q, k, v, segment_ids, columns, *, prefix_ids=None,
                              block: int | None = None) -> jax.Array:
    """q [B, T, N, H], k/v [B, T, K, H], segment_ids / columns / prefix_ids [B, T] int →
    [B, T, N, H] in q's dtype (module docstring). ``columns``: each token's column in its
    packed row, the same on every row (:func:`zigzag_order`'s under context
    parallelism). On a mesh whose context axis has C > 1 devices the operands are split
    over it on T (rows over the batch axes, heads over the tensor axis where they divide)
    and each device computes its own queries; otherwise the same algorithm runs on the
    whole row. ``block`` defaults to :func:`context_block`."""
    shards = context_shards()
    length = q.shape[1]
    error = context_length_error(length, shards)
    if error is not None:
        raise ValueError(error)
    block = block or context_block(length, shards)
    piece = length // (2 * shards) if shards > 1 else length
    if piece % block or length % piece:
        raise ValueError(f"context attention: block {block} must divide the piece {piece} "
                         f"of a {length}-token row")
    operands = [q, k, v, segment_ids.astype(jnp.int32), columns.astype(jnp.int32)]
    has_prefix = prefix_ids is not None
    if has_prefix:
        operands.append(prefix_ids.astype(jnp.int32))
    if shards == 1:
        return _attention(*operands[:5], operands[5] if has_prefix else None, None, block,
                          piece)

    def local(*xs):
        return _attention(*xs[:5], xs[5] if has_prefix else None, CONTEXT_AXIS, block, piece)

    mesh = kernel_mesh()
    rows = batch_spec(mesh, q.shape[0])
    x = P(rows, CONTEXT_AXIS, head_spec(mesh, q.shape[2], k.shape[2]), None)
    ids = P(rows, CONTEXT_AXIS)
    specs = (x, x, x, ids, ids) + ((ids,) if has_prefix else ())
    return jax.shard_map(local, mesh=mesh, in_specs=specs, out_specs=x,
                         check_vma=False)(*operands)


__all__ = ["context_block", "context_length_error", "context_segment_attention",
           "context_shards", "zigzag_order"]
