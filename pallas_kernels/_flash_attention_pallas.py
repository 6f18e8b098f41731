"""Causal flash attention with segment ids that skips block pairs nobody attends to (Pallas).

Shapes: ``q [B, T, N, H]``, ``k, v [B, T, K, H]`` with ``N % K == 0`` (grouped-query
attention: query head ``n`` reads kv head ``n // G``, ``G = N / K``), ``segment_ids [B, T]``
int32 (0 = padding; a packed row holds sequences 1, 2, ...). Query ``t`` attends to key ``s``
iff

    s ≤ t   and   seg[t] ≠ 0   and   (seg[s] = seg[t]   or   seg[s] = pre[t] ≠ 0),

where the optional ``prefix_ids`` ``pre [B, T]`` (tree packing, 0 = none; without it the
last clause is seg[s] = seg[t]) let each continuation of a group read the group's one shared
prompt segment and not its siblings (``_segment_blocks``);

    S = q·kᵀ · c  (c = H^-½),   lse_t = log Σ_{s ∈ A(t)} exp S_ts,
    P = exp(S − lse),           O = P·V,

with all softmax statistics in fp32 and ``O`` in q's dtype. Padding queries (seg 0) attend to
nothing: their output is 0 and they pass no gradient anywhere. Backward (FlashAttention-2):

    D_t = Σ_h dO_th·O_th,   dV = Pᵀ·dO,   dP = dO·Vᵀ,   dS = P ⊙ (dP − D),
    dQ = dS·K · c,          dK = dSᵀ·Q · c.

Kernels (Triton layout; ``interpret=True`` runs them on CPU):
  forward  grid (B, N, query blocks i): online softmax over key blocks j ∈ [lo_i, hi_i)
           (``fori_loop`` with dynamic bounds; with prefix ids two such loops, below),
           saves ``O`` and ``lse [B, N, T]``.
  dq       grid (B, N, query blocks i): the same key-block range(s), accumulates dQ_i.
  dk/dv    ``dkdv_grid="kv_heads"``: grid (B, K, key blocks j), loops over the G query heads
           of kv head k and the query blocks i ∈ [lo_j, hi_j), accumulates dK_j, dV_j (GQA
           needs no atomics and no per-query-head copies). ``"query_heads"``: grid (B, N,
           key blocks j), one query head per program, writing fp32 per-query-head
           dK, dV [B, T, N, H] that are then summed over each kv head's G heads, as
           FlashAttention-2 does for GQA: G× the programs (Qwen2.5-0.5B: 7×; the kv-head
           grid gives a 16k-token row 256 programs for a GPU's 132 SMs against the
           forward's 1,792) for G× the dK/dV writes.
``D`` is one elementwise product and row sum, done in jnp before the backward kernels.

Skip rule (``_segment_blocks``, computed in the wrapper, exact for any ids): each query
block loops over ``[lo_i, hi_i)`` = first..last key block it needs (each key block over
first..last query block that needs it). For packed rows the needed blocks are contiguous, so
the range is exactly them; for arbitrary ids it is a superset, kept exact by a ``jnp.where``
mask (causal, same id, nonzero) inside each computed pair. With ``block_q = block_k``, a row
of segments no longer than a block computes ≤ 2 pairs per query block instead of the ~nq/2
of the causal triangle (``segment_attention.attended_block_pairs`` counts both).

With prefix ids the needed key blocks of a continuation's query block are two runs: its
prefix's blocks and its own, with its earlier siblings' blocks between them. So forward and
dq walk two ranges per query block, the range of the pairs needed via the prefix and that
of the pairs needed for own-segment keys (``needed_block_pairs(..., parts=True)``): the one
that starts first, then the other from max(its lo, the first's hi), so no block is visited
twice and sibling blocks that no query of the block reads are not visited. (Either range
may start first: a block holding the end of a flat segment begun earlier, then a prefix,
needs own-segment blocks before the prefix's.) dk/dv keeps one query-block range per key
block, over the union (the queries that read a prefix block, the prefix's own and its
continuations', are one run). The flat kernels (no prefix ids) take neither the prefix
input nor the second range.

Padding: T is padded to a multiple of the blocks (padded positions get id 0, so they are never
computed) and H to a power of two ≥ 16 (zeros: dot products unchanged); Triton tensors must
have power-of-two sizes and ``tl.dot`` wants dimensions ≥ 16, hence also block sizes that are
powers of two ≥ 16.
"""

from __future__ import annotations

import functools
import math

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as pltriton

from pallas_kernels._segment_blocks import needed_block_pairs, pair_mask
from pallas_kernels._shapes import is_pow2, round_up
from pallas_kernels._softmax_math import NEG_LOGIT, matmul_precision

_F32 = jnp.float32


# ----------------------------------------------------------------------------- skip rule


def _ranges(needed, axis: int):
    """``[..., 2]`` int32 ``[first, last + 1)`` of the True entries along ``axis``; ``[0, 0)``
    where there are none (the kernel's loop then runs zero times)."""
    n = needed.shape[axis]
    shape = [1] * needed.ndim
    shape[axis] = n
    idx = jnp.arange(n, dtype=jnp.int32).reshape(shape)
    any_ = jnp.any(needed, axis=axis)
    lo = jnp.min(jnp.where(needed, idx, n), axis=axis)
    hi = jnp.max(jnp.where(needed, idx + 1, 0), axis=axis)
    return jnp.stack([jnp.where(any_, lo, 0), hi], axis=-1).astype(jnp.int32)


def _disjoint_pair(a, b):
    """``[..., 4]`` int32: two ranges, the ``[lo, hi)`` of ``a`` and ``b`` (``[..., 2]``),
    that cover their union with no index twice: the one starting first, then the other
    from max(its lo, the first's hi) (empty where the first covers it). An empty range is
    ``[0, 0)``, so it sorts first and leaves the other whole."""
    swap = b[..., :1] < a[..., :1]
    first, second = jnp.where(swap, b, a), jnp.where(swap, a, b)
    lo = jnp.maximum(second[..., 0], first[..., 1])
    hi = jnp.maximum(second[..., 1], lo)
    return jnp.concatenate([first, lo[..., None], hi[..., None]], axis=-1)


def block_bounds(seg, block_q: int, block_k: int, prefix=None):
    """``(kv_bounds, q_bounds [B, nk, 2])``: the key-block range(s) each query block loops
    over (forward, dq) and the query-block range each key block loops over (dk/dv).
    ``kv_bounds`` is ``[B, nq, 2]`` without ``prefix``; with it ``[B, nq, 4]``, the two
    disjoint ranges covering the pairs needed via the prefix and for own-segment keys."""
    if prefix is None:
        needed = needed_block_pairs(seg, block_q, block_k)
        return _ranges(needed, axis=2), _ranges(needed, axis=1)
    own, via = needed_block_pairs(seg, block_q, block_k, prefix, parts=True)
    kv_bounds = _disjoint_pair(_ranges(via, axis=2), _ranges(own, axis=2))
    return kv_bounds, _ranges(own | via, axis=1)


def _padded_length(length: int, block_q: int, block_k: int) -> int:
    return round_up(length, math.lcm(block_q, block_k))


# ----------------------------------------------------------------------------- kernel helpers


def _dot(a, b, dims):
    return lax.dot_general(a, b, (dims, ((), ())), preferred_element_type=_F32,
                           precision=matmul_precision(a.dtype))


def _dot_nn(a, b):
    """``a [m, k] · b [k, n]`` in fp32."""
    return _dot(a, b, ((1,), (0,)))


def _dot_nt(a, b):
    """``a [m, k] · b [n, k]ᵀ`` in fp32."""
    return _dot(a, b, ((1,), (1,)))


def _dot_tn(a, b):
    """``a [k, m]ᵀ · b [k, n]`` in fp32."""
    return _dot(a, b, ((0,), (0,)))


def _scores(q, k, scale):
    return _dot_nt(q, k) * scale


# ----------------------------------------------------------------------------- forward


def _split_prefix(refs, tree: bool):
    """(prefix ids ref or None, the other refs): tree kernels take ``pre`` right after
    ``seg``; the flat kernels have no such input."""
    return (refs[0], refs[1:]) if tree else (None, refs)


def _read_ranges(bnd_ref):
    """The ``(lo, hi)`` pairs of a program's bounds: one, or two disjoint ones with prefix
    ids (``block_bounds``)."""
    return [(bnd_ref[2 * r], bnd_ref[2 * r + 1]) for r in range(bnd_ref.shape[0] // 2)]


def _walk(ranges, body, init):
    """``body`` over every block of each ``[lo, hi)`` in ``ranges``, in order, threading
    ``init`` through (``fori_loop``s with dynamic bounds)."""
    carry = init
    for lo, hi in ranges:
        carry = lax.fori_loop(lo, hi, body, carry)
    return carry


def _fwd_kernel(q_ref, k_ref, v_ref, seg_ref, *refs, scale, block_q, block_k, tree):
    pre_ref, (bnd_ref, o_ref, lse_ref) = _split_prefix(refs, tree)
    i = pl.program_id(2)
    q_start = i * block_q
    q = q_ref[...]
    q_seg = seg_ref[pl.ds(q_start, block_q)]
    q_pre = None if pre_ref is None else pre_ref[pl.ds(q_start, block_q)]
    ranges = _read_ranges(bnd_ref)

    def body(j, carry):
        acc, m, l = carry
        keys = pl.ds(j * block_k, block_k)
        k, v = k_ref[keys, :], v_ref[keys, :]
        mask = pair_mask(q_start, q_seg, j * block_k, seg_ref[keys], q_pre)
        s = jnp.where(mask, _scores(q, k, scale), NEG_LOGIT)
        m_new = jnp.maximum(m, jnp.max(s, axis=1))
        # Rows with nothing attended so far keep m = NEG_LOGIT, where exp(s − m) would be 1
        # for masked entries: the where zeroes them, so l and acc stay exactly 0.
        p = jnp.where(mask, jnp.exp(s - m_new[:, None]), 0.0)
        corr = jnp.exp(m - m_new)
        l = l * corr + jnp.sum(p, axis=1)
        acc = acc * corr[:, None] + _dot_nn(p.astype(v.dtype), v)
        return acc, m_new, l

    init = (jnp.zeros(q.shape, _F32), jnp.full((block_q,), NEG_LOGIT, _F32),
            jnp.zeros((block_q,), _F32))
    acc, m, l = _walk(ranges, body, init)
    # Padding queries (and any query of a block with an empty range) have l = 0: output 0,
    # lse 0 (finite; the backward never reads it since their mask is all False).
    has = l > 0
    l_safe = jnp.where(has, l, 1.0)
    o_ref[...] = (acc / l_safe[:, None]).astype(o_ref.dtype)
    lse_ref[...] = jnp.where(has, m + jnp.log(l_safe), 0.0)


def _compiler_params(head_dim: int, interpret: bool):
    if interpret:
        return None
    return pltriton.CompilerParams(num_warps=4 if head_dim <= 64 else 8, num_stages=2)


def _ids_inputs(seg, pre, index_map):
    """(arrays, BlockSpecs) of the id rows each program reads whole: ``seg``, and ``pre``
    after it when given."""
    ids = (seg,) if pre is None else (seg, pre)
    return ids, [pl.BlockSpec((None, seg.shape[1]), index_map) for _ in ids]


def _forward(q, k, v, seg, pre, kv_bounds, *, scale, block_q, block_k, interpret):
    b, tp, n, hd = q.shape
    group = n // k.shape[2]
    nq = tp // block_q
    kernel = functools.partial(_fwd_kernel, scale=scale, block_q=block_q, block_k=block_k,
                               tree=pre is not None)
    kv_spec = pl.BlockSpec((None, tp, None, hd), lambda bi, h, i: (bi, 0, lax.div(h, group), 0))
    q_spec = pl.BlockSpec((None, block_q, None, hd), lambda bi, h, i: (bi, i, h, 0))
    ids, id_specs = _ids_inputs(seg, pre, lambda bi, h, i: (bi, 0))
    out, lse = pl.pallas_call(
        kernel,
        out_shape=[jax.ShapeDtypeStruct(q.shape, q.dtype),
                   jax.ShapeDtypeStruct((b, n, tp), _F32)],
        grid=(b, n, nq),
        in_specs=[
            q_spec,
            kv_spec,
            kv_spec,
            *id_specs,
            pl.BlockSpec((None, None, kv_bounds.shape[-1]), lambda bi, h, i: (bi, i, 0)),
        ],
        out_specs=[q_spec, pl.BlockSpec((None, None, block_q), lambda bi, h, i: (bi, h, i))],
        compiler_params=_compiler_params(hd, interpret),
        interpret=interpret,
        name="segment_attention_fwd",
    )(q, k, v, *ids, kv_bounds)
    return out, lse


# ----------------------------------------------------------------------------- backward


def _dq_kernel(q_ref, k_ref, v_ref, seg_ref, *refs, scale, block_q, block_k, tree):
    pre_ref, (bnd_ref, do_ref, lse_ref, delta_ref, dq_ref) = _split_prefix(refs, tree)
    i = pl.program_id(2)
    q_start = i * block_q
    q, do = q_ref[...], do_ref[...]
    lse, delta = lse_ref[...], delta_ref[...]
    q_seg = seg_ref[pl.ds(q_start, block_q)]
    q_pre = None if pre_ref is None else pre_ref[pl.ds(q_start, block_q)]
    ranges = _read_ranges(bnd_ref)

    def body(j, dq):
        keys = pl.ds(j * block_k, block_k)
        k, v = k_ref[keys, :], v_ref[keys, :]
        mask = pair_mask(q_start, q_seg, j * block_k, seg_ref[keys], q_pre)
        # Masked scores become NEG_LOGIT, and exp(NEG_LOGIT − lse) = 0 for the finite lse of
        # every query (0 at padding queries), so P = exp(S − lse) exactly on the attended set.
        p = jnp.exp(jnp.where(mask, _scores(q, k, scale), NEG_LOGIT) - lse[:, None])
        ds = p * (_dot_nt(do, v) - delta[:, None])
        return dq + _dot_nn(ds.astype(k.dtype), k)

    dq = _walk(ranges, body, jnp.zeros(q.shape, _F32))
    dq_ref[...] = dq * scale


def _dkdv_kernel(q_ref, k_ref, v_ref, seg_ref, *refs, scale, block_q, block_k, group, tree):
    pre_ref, (bnd_ref, do_ref, lse_ref, delta_ref, dk_ref, dv_ref) = _split_prefix(refs, tree)
    j = pl.program_id(2)
    k_start = j * block_k
    k, v = k_ref[...], v_ref[...]
    k_seg = seg_ref[pl.ds(k_start, block_k)]
    lo, hi = bnd_ref[0], bnd_ref[1]

    def head(g, carry):
        # q_ref / do_ref hold the G query heads of this kv head: [Tp, G, H]; lse / D: [G, Tp].
        def body(i, carry):
            dk, dv = carry
            rows = pl.ds(i * block_q, block_q)
            q, do = q_ref[rows, g, :], do_ref[rows, g, :]
            lse, delta = lse_ref[g, rows], delta_ref[g, rows]
            q_pre = None if pre_ref is None else pre_ref[rows]
            mask = pair_mask(i * block_q, seg_ref[rows], k_start, k_seg, q_pre)
            p = jnp.exp(jnp.where(mask, _scores(q, k, scale), NEG_LOGIT) - lse[:, None])
            dv = dv + _dot_tn(p.astype(do.dtype), do)
            ds = p * (_dot_nt(do, v) - delta[:, None])
            dk = dk + _dot_tn(ds.astype(q.dtype), q)
            return dk, dv

        return lax.fori_loop(lo, hi, body, carry)

    zeros = jnp.zeros(k.shape, _F32)
    dk, dv = lax.fori_loop(0, group, head, (zeros, zeros))
    dk_ref[...] = dk * scale
    dv_ref[...] = dv


DKDV_GRIDS = ("kv_heads", "query_heads")


def _backward(q, k, v, seg, pre, out, lse, do, kv_bounds, q_bounds, *, scale, block_q,
              block_k, interpret, dkdv_grid="kv_heads"):
    b, tp, n, hd = q.shape
    kv_heads = k.shape[2]
    group = n // kv_heads
    # D_t = rowsum(dO ⊙ O) per query and head, fp32, laid out like lse: [B, N, Tp].
    delta = jnp.einsum("btnh,btnh->bnt", do.astype(_F32), out.astype(_F32),
                       precision=lax.Precision.HIGHEST)
    params = _compiler_params(hd, interpret)

    q_spec = pl.BlockSpec((None, block_q, None, hd), lambda bi, h, i: (bi, i, h, 0))
    kv_full = pl.BlockSpec((None, tp, None, hd), lambda bi, h, i: (bi, 0, lax.div(h, group), 0))
    row_spec = pl.BlockSpec((None, None, block_q), lambda bi, h, i: (bi, h, i))
    ids, id_specs = _ids_inputs(seg, pre, lambda bi, h, i: (bi, 0))
    dq = pl.pallas_call(
        functools.partial(_dq_kernel, scale=scale, block_q=block_q, block_k=block_k,
                          tree=pre is not None),
        out_shape=jax.ShapeDtypeStruct(q.shape, _F32),
        grid=(b, n, tp // block_q),
        in_specs=[
            q_spec, kv_full, kv_full,
            *id_specs,
            pl.BlockSpec((None, None, kv_bounds.shape[-1]), lambda bi, h, i: (bi, i, 0)),
            q_spec, row_spec, row_spec,
        ],
        out_specs=q_spec,
        compiler_params=params,
        interpret=interpret,
        name="segment_attention_dq",
    )(q, k, v, *ids, kv_bounds, do, lse, delta)

    dk, dv = _dkdv(q, k, v, seg, pre, q_bounds, do, lse, delta, scale=scale, block_q=block_q,
                   block_k=block_k, params=params, interpret=interpret,
                   per_query_head=dkdv_grid == "query_heads")
    return dq.astype(q.dtype), dk.astype(k.dtype), dv.astype(v.dtype)


def _dkdv(q, k, v, seg, pre, q_bounds, do, lse, delta, *, scale, block_q, block_k, params,
          interpret, per_query_head: bool):
    """dK, dV (fp32) by ``_dkdv_kernel`` (module docstring's dk/dv). Over kv heads, each
    program reads the G query heads of its kv head (a q block of G heads) and writes its kv
    head's dK, dV. Over query heads, each program reads one query head (a group of one) and
    the key block of that head's kv head, and writes per-query-head results, which are then
    summed over each kv head's G heads."""
    b, tp, n, hd = q.shape
    kv_heads = k.shape[2]
    group = n // kv_heads
    heads, per_program = (n, 1) if per_query_head else (kv_heads, group)
    q_heads = pl.BlockSpec((None, tp, per_program, hd), lambda bi, h, j: (bi, 0, h, 0))
    rows = pl.BlockSpec((None, per_program, tp), lambda bi, h, j: (bi, h, 0))
    kv_block = pl.BlockSpec((None, block_k, None, hd),
                            lambda bi, h, j: (bi, j, lax.div(h, group // per_program), 0))
    out_block = pl.BlockSpec((None, block_k, None, hd), lambda bi, h, j: (bi, j, h, 0))
    out_shape = (b, tp, heads, hd)
    ids, id_specs = _ids_inputs(seg, pre, lambda bi, h, j: (bi, 0))
    dk, dv = pl.pallas_call(
        functools.partial(_dkdv_kernel, scale=scale, block_q=block_q, block_k=block_k,
                          group=per_program, tree=pre is not None),
        out_shape=[jax.ShapeDtypeStruct(out_shape, _F32)] * 2,
        grid=(b, heads, tp // block_k),
        in_specs=[
            q_heads, kv_block, kv_block,
            *id_specs,
            pl.BlockSpec((None, None, 2), lambda bi, h, j: (bi, j, 0)),
            q_heads, rows, rows,
        ],
        out_specs=[out_block, out_block],
        compiler_params=params,
        interpret=interpret,
        name="segment_attention_dkdv" + ("_per_query_head" if per_query_head else ""),
    )(q, k, v, *ids, q_bounds, do, lse, delta)
    if per_query_head:  # query head n belongs to kv head n // G: groups are contiguous
        dk, dv = (x.reshape(b, tp, kv_heads, group, hd).sum(axis=3) for x in (dk, dv))
    return dk, dv


# ----------------------------------------------------------------------------- custom VJP


@functools.partial(jax.custom_vjp, nondiff_argnums=(5, 6, 7, 8, 9))
def _attention(q, k, v, seg, pre, scale, block_q, block_k, interpret, dkdv_grid):
    """Padded attention; ``pre`` is the prefix ids [B, Tp] or None (the flat kernels)."""
    out, _ = _attention_fwd(q, k, v, seg, pre, scale, block_q, block_k, interpret, dkdv_grid)
    return out


def _attention_fwd(q, k, v, seg, pre, scale, block_q, block_k, interpret, dkdv_grid):
    del dkdv_grid  # a backward choice
    kv_bounds, q_bounds = block_bounds(seg, block_q, block_k, pre)
    out, lse = _forward(q, k, v, seg, pre, kv_bounds, scale=scale, block_q=block_q,
                        block_k=block_k, interpret=interpret)
    return out, (q, k, v, seg, pre, out, lse, kv_bounds, q_bounds)


def _attention_bwd(scale, block_q, block_k, interpret, dkdv_grid, res, do):
    q, k, v, seg, pre, out, lse, kv_bounds, q_bounds = res
    dq, dk, dv = _backward(q, k, v, seg, pre, out, lse, do.astype(q.dtype), kv_bounds,
                           q_bounds, scale=scale, block_q=block_q, block_k=block_k,
                           interpret=interpret, dkdv_grid=dkdv_grid)
    return dq, dk, dv, None, None


_attention.defvjp(_attention_fwd, _attention_bwd)


def triton_block(dtype, head_dim: int) -> int:
    """Query/key block that fits a Hopper SM's 227 KiB of shared memory with two pipeline
    stages. Measured on an H200 (``docs/benchmarks.md``, "On a GPU"): bf16 ran at 128 with
    head_dim 64 and 128; fp32 (TF32 dots) at 128 asked for 263,680 bytes and failed, at 64
    ran. The tiles grow with block · head_dim (and fp32 doubles them), so the block halves
    again past those head dims (not measured)."""
    wide = jnp.dtype(dtype).itemsize >= 4
    limit = 64 if wide else 128  # the largest head_dim measured at the larger block
    block = 64 if wide else 128
    return block if head_dim <= limit else block // 2


@functools.partial(jax.jit, static_argnames=("block_q", "block_k", "interpret", "dkdv_grid"))
def pallas_segment_attention(q, k, v, segment_ids, *, prefix_ids=None, block_q: int = 128,
                             block_k: int = 128, interpret: bool = False,
                             dkdv_grid: str = "kv_heads") -> jax.Array:
    """Causal attention within segments (module docstring), differentiable in q, k, v.

    ``q [B, T, N, H]``, ``k, v [B, T, K, H]`` (same dtype, N % K == 0), ``segment_ids [B, T]``
    int (0 = padding), ``prefix_ids [B, T]`` int or None (tree packing: the segment id each
    query also reads, 0 = none). Returns ``[B, T, N, H]`` in q's dtype; zeros at padding
    queries. ``interpret=True`` runs the kernels on CPU. ``dkdv_grid``: how the dK/dV kernel
    is laid out (module docstring); the default is the one measured on an H200.
    """
    b, length, n, hd = q.shape
    if k.shape != v.shape or k.shape[:2] != (b, length) or k.shape[3] != hd:
        raise ValueError(f"k/v shapes {k.shape}, {v.shape} do not match q {q.shape}")
    if n % k.shape[2]:
        raise ValueError(f"query heads {n} must be a multiple of kv heads {k.shape[2]}")
    if not (q.dtype == k.dtype == v.dtype):
        raise ValueError(f"q, k, v dtypes differ: {q.dtype}, {k.dtype}, {v.dtype}")
    if segment_ids.shape != (b, length):
        raise ValueError(f"segment_ids shape {segment_ids.shape} != {(b, length)}")
    if prefix_ids is not None and prefix_ids.shape != (b, length):
        raise ValueError(f"prefix_ids shape {prefix_ids.shape} != {(b, length)}")
    if dkdv_grid not in DKDV_GRIDS:
        raise ValueError(f"dkdv_grid={dkdv_grid!r}; expected one of {DKDV_GRIDS}")
    for name, blk in (("block_q", block_q), ("block_k", block_k)):
        if not (is_pow2(blk) and blk >= 16):
            raise ValueError(f"{name}={blk} must be a power of two ≥ 16 (Triton tiles)")
    tp = _padded_length(length, block_q, block_k)
    hp = max(16, 1 << (hd - 1).bit_length())
    pad = ((0, 0), (0, tp - length), (0, 0), (0, hp - hd))
    qp, kp, vp = (x if tp == length and hp == hd else jnp.pad(x, pad) for x in (q, k, v))
    # Padded positions get id 0 (never attended) and prefix id 0 (none).
    seg, pre = (None if ids is None else jnp.pad(ids.astype(jnp.int32), ((0, 0), (0, tp - length)))
                for ids in (segment_ids, prefix_ids))
    out = _attention(qp, kp, vp, seg, pre, hd**-0.5, block_q, block_k, interpret, dkdv_grid)
    return out[:, :length, :, :hd]
