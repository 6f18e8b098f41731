"""Pallas kernels for fused lm-head logprobs/entropy, in two families.

``tpu`` family (Mosaic; also what interpret mode runs on CPU by default). Grid
``(token blocks i, vocab blocks j)`` with j innermost and sequential ("arbitrary"): the output
blocks ``[block_n, 1]`` do not depend on j, so they stay resident and serve as the fp32
accumulators of the online max/sum-exp. The ragged last vocab block reads past V: those
columns are garbage (NaN in interpret mode) and are masked by column id. The backward is two
kernels with the same tiling: ``dh`` accumulates over j on grid (i, j), ``dW`` accumulates over
i on grid (j, i), both recomputing the logit tile; dW leaves it in W's dtype (a bf16 head's
fp32 sums stay in a VMEM accumulator), so no fp32 copy of the whole head exists.

``gpu`` family (Triton). Triton runs every grid point in parallel, so nothing can be
accumulated across the grid. The forward uses grid ``(token blocks, vocab splits)`` and a
``fori_loop`` over the vocab blocks of its split; the per-split stats are merged by
``combine_stats``. The backward is one kernel on grid ``(token blocks, vocab blocks)`` that
recomputes its logit tile and ``atomic_add``s its contributions into fp32 ``dh`` and ``dW``
(order of fp32 additions, hence the last bits, is not deterministic). Triton tensors must have
power-of-two sizes, so D is walked in ``block_d`` chunks, and D / V / N are zero-padded up to
their blocks (only when ragged; the chooser prefers divisors) so every load is in bounds.

Both families share the math in ``_softmax_math`` and take ``interpret=True`` on CPU.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import tpu as pltpu
from jax.experimental.pallas import triton as pltriton

from pallas_kernels._softmax_math import (
    block_logits,
    combine_stats,
    finalize_stats,
    init_stats,
    logit_cotangent,
    mask_logits,
    matmul_precision,
    update_stats,
)

_F32 = jnp.float32


def _pad_rows(x, rows: int):
    return x if x.shape[0] == rows else jnp.pad(x, ((0, rows - x.shape[0]),) + ((0, 0),) *
                                                (x.ndim - 1))


def _col_ids(j, block_v: int, shape):
    return j * block_v + lax.broadcasted_iota(jnp.int32, shape, len(shape) - 1)


def _dot_nt(a, b):
    """``a [m, k] · b [n, k]ᵀ`` in fp32."""
    return lax.dot_general(a, b, (((1,), (1,)), ((), ())), preferred_element_type=_F32,
                           precision=matmul_precision(a.dtype))


def _dot_tn(a, b):
    """``a [k, m]ᵀ · b [k, n]`` in fp32."""
    return lax.dot_general(a, b, (((0,), (0,)), ((), ())), preferred_element_type=_F32,
                           precision=matmul_precision(a.dtype))


# Triton software-pipelines the D loop over this many chunks (loads of chunk k+1 overlap the
# matmul of chunk k); the shared memory of one chunk is `gpu_shared_bytes(..., stages=1)`.
GPU_STAGES = 2


def gpu_shared_bytes(block_n: int, block_v: int, block_d: int, itemsize: int,
                     stages: int = GPU_STAGES) -> int:
    """Shared memory the GPU kernels' D loop holds: per stage the h tile ``[block_n,
    block_d]`` and two copies of the W tile ``[block_d, block_v]`` (its load and the MMA
    operand layout). Fits what Triton asked of an H200 for the unrolled loop at D = 896 fp32
    (7 chunks · 160 KiB = 1,146,880 bytes)."""
    return stages * block_d * (block_n + 2 * block_v) * itemsize


def _gpu_params(interpret: bool):
    if interpret:
        return None
    return pltriton.CompilerParams(num_warps=4, num_stages=GPU_STAGES)


def _tpu_params(interpret: bool, semantics):
    if interpret:
        return None
    return pltpu.CompilerParams(dimension_semantics=semantics)


# ----------------------------------------------------------------------------- tpu family


def _tpu_fwd_kernel(h_ref, w_ref, tgt_ref, *out_refs, temperature, vocab_size, block_v,
                    with_entropy):
    j = pl.program_id(1)

    @pl.when(j == 0)
    def _init():
        # Without entropy there are 3 outputs (m, s, t): zip drops the unused accumulator.
        for ref, value in zip(out_refs, init_stats(out_refs[0].shape), strict=False):
            ref[...] = value

    z = block_logits(h_ref[...], w_ref[...], temperature)
    col = _col_ids(j, block_v, z.shape)
    z = mask_logits(z, col, vocab_size)
    if with_entropy:
        stats = tuple(ref[...] for ref in out_refs)
    else:
        stats = (*(ref[...] for ref in out_refs), jnp.zeros_like(out_refs[0][...]))
    stats = update_stats(stats, z, col, tgt_ref[...], with_entropy=with_entropy)
    for ref, value in zip(out_refs, stats, strict=False):
        ref[...] = value


def _tpu_forward(hidden, lm_head, tgt, *, temperature, with_entropy, block_n, block_v,
                 interpret):
    n_pad, d = hidden.shape
    v = lm_head.shape[1]
    grid = (n_pad // block_n, pl.cdiv(v, block_v))
    row_spec = pl.BlockSpec((block_n, 1), lambda i, j: (i, 0))
    n_out = 4 if with_entropy else 3
    kernel = functools.partial(_tpu_fwd_kernel, temperature=temperature, vocab_size=v,
                               block_v=block_v, with_entropy=with_entropy)
    stats = pl.pallas_call(
        kernel,
        out_shape=[jax.ShapeDtypeStruct((n_pad, 1), _F32)] * n_out,
        grid=grid,
        in_specs=[
            pl.BlockSpec((block_n, d), lambda i, j: (i, 0)),
            pl.BlockSpec((d, block_v), lambda i, j: (0, j)),
            row_spec,
        ],
        out_specs=[row_spec] * n_out,
        compiler_params=_tpu_params(interpret, ("parallel", "arbitrary")),
        interpret=interpret,
        name="token_logprobs_fwd",
    )(hidden, lm_head, tgt)
    if not with_entropy:
        stats = (*stats, jnp.zeros_like(stats[0]))
    return stats


def _tile_cotangent(h, w, j, tgt, lse, g_lp, g_h, ent, *, temperature, vocab_size, block_v):
    """Recompute one logit tile and return ``dlogits = dz / T`` (fp32) and the column mask."""
    z = block_logits(h, w, temperature)
    col = _col_ids(j, block_v, z.shape)
    z = mask_logits(z, col, vocab_size)
    dz = logit_cotangent(z, col, tgt, lse, g_lp, g_h, ent)
    return dz / temperature


def _tpu_dh_kernel(h_ref, w_ref, tgt_ref, lse_ref, glp_ref, *rest, temperature, vocab_size,
                   block_v, with_entropy_grad):
    if with_entropy_grad:
        gh_ref, ent_ref, dh_ref = rest
        g_h, ent = gh_ref[...], ent_ref[...]
    else:
        (dh_ref,) = rest
        g_h = ent = None
    j = pl.program_id(1)

    @pl.when(j == 0)
    def _init():
        dh_ref[...] = jnp.zeros(dh_ref.shape, _F32)

    w = w_ref[...]
    dlogits = _tile_cotangent(h_ref[...], w, j, tgt_ref[...], lse_ref[...], glp_ref[...], g_h,
                              ent, temperature=temperature, vocab_size=vocab_size,
                              block_v=block_v)
    # dh contracts over the vocab, so the garbage columns of a ragged W block must be zeroed
    # (their dlogits are 0, but 0·NaN is NaN).
    w_valid = _col_ids(j, block_v, (1, w.shape[1])) < vocab_size
    w = jnp.where(w_valid, w, jnp.zeros_like(w))
    dh_ref[...] += _dot_nt(dlogits.astype(w.dtype), w)


def _tpu_dw_kernel(h_ref, w_ref, tgt_ref, lse_ref, glp_ref, *rest, temperature, vocab_size,
                   block_v, with_entropy_grad):
    if with_entropy_grad:
        gh_ref, ent_ref, dw_ref, *scratch = rest
        g_h, ent = gh_ref[...], ent_ref[...]
    else:
        dw_ref, *scratch = rest
        g_h = ent = None
    # fp32 sums: in the output block itself for an fp32 W, else in a VMEM accumulator that is
    # cast once into the (W-dtype) output block after the last token block.
    acc_ref = scratch[0] if scratch else dw_ref
    j, i = pl.program_id(0), pl.program_id(1)

    @pl.when(i == 0)
    def _init():
        acc_ref[...] = jnp.zeros(acc_ref.shape, _F32)

    h = h_ref[...]
    dlogits = _tile_cotangent(h, w_ref[...], j, tgt_ref[...], lse_ref[...], glp_ref[...], g_h,
                              ent, temperature=temperature, vocab_size=vocab_size,
                              block_v=block_v)
    # Garbage columns of dW's ragged last block are dropped when the block is written back.
    acc_ref[...] += _dot_tn(h, dlogits.astype(h.dtype))

    if scratch:
        @pl.when(i == pl.num_programs(1) - 1)
        def _store():
            dw_ref[...] = acc_ref[...].astype(dw_ref.dtype)


def _tpu_backward(hidden, lm_head, tgt, lse, g_lp, g_h, ent, *, temperature, block_n, block_v,
                  interpret):
    n_pad, d = hidden.shape
    v = lm_head.shape[1]
    n_blocks, v_blocks = n_pad // block_n, pl.cdiv(v, block_v)
    row_inputs = [tgt, lse, g_lp] + ([g_h, ent] if g_h is not None else [])
    static = dict(temperature=temperature, vocab_size=v, block_v=block_v,
                  with_entropy_grad=g_h is not None)

    dh = pl.pallas_call(
        functools.partial(_tpu_dh_kernel, **static),
        out_shape=jax.ShapeDtypeStruct((n_pad, d), _F32),
        grid=(n_blocks, v_blocks),
        in_specs=[
            pl.BlockSpec((block_n, d), lambda i, j: (i, 0)),
            pl.BlockSpec((d, block_v), lambda i, j: (0, j)),
        ] + [pl.BlockSpec((block_n, 1), lambda i, j: (i, 0))] * len(row_inputs),
        out_specs=pl.BlockSpec((block_n, d), lambda i, j: (i, 0)),
        compiler_params=_tpu_params(interpret, ("parallel", "arbitrary")),
        interpret=interpret,
        name="token_logprobs_bwd_dh",
    )(hidden, lm_head, *row_inputs)

    # dW leaves the kernel in W's dtype: an fp32 [D, V] output would be a whole-head
    # temporary (519 MiB at the Qwen2.5-0.5B head) before the cast to bf16.
    fp32_head = lm_head.dtype == _F32
    dw = pl.pallas_call(
        functools.partial(_tpu_dw_kernel, **static),
        out_shape=jax.ShapeDtypeStruct((d, v), lm_head.dtype),
        scratch_shapes=[] if fp32_head else [pltpu.VMEM((d, block_v), _F32)],
        grid=(v_blocks, n_blocks),
        in_specs=[
            pl.BlockSpec((block_n, d), lambda j, i: (i, 0)),
            pl.BlockSpec((d, block_v), lambda j, i: (0, j)),
        ] + [pl.BlockSpec((block_n, 1), lambda j, i: (i, 0))] * len(row_inputs),
        out_specs=pl.BlockSpec((d, block_v), lambda j, i: (0, j)),
        compiler_params=_tpu_params(interpret, ("parallel", "arbitrary")),
        interpret=interpret,
        name="token_logprobs_bwd_dw",
    )(hidden, lm_head, *row_inputs)
    return dh, dw


# ----------------------------------------------------------------------------- gpu family


def _gpu_d_chunk(k, block_d: int):
    return pl.ds(pl.multiple_of(k * block_d, block_d), block_d)


def _gpu_tile_logits(h_ref, w_ref, rows, col0, *, d_blocks, block_d, block_v, temperature):
    """``z = h[rows] @ W[:, col0:col0+block_v] / T`` walking D in power-of-two chunks.

    A loop, not a Python unroll: unrolled, every chunk's tiles were live at once and the
    shared memory grew with D (Qwen2.5-0.5B, D = 896 in 7 fp32 chunks, asked an H200 for
    1.1 MB of its 227 KiB); looped, it is ``num_stages`` chunks (``gpu_shared_bytes``)."""
    def body(k, z):
        dk = _gpu_d_chunk(k, block_d)
        return z + block_logits(h_ref[rows, dk], w_ref[dk, pl.ds(col0, block_v)], 1.0)

    z = lax.fori_loop(0, d_blocks, body, jnp.zeros((rows.size, block_v), _F32))
    return z / temperature


def _gpu_fwd_kernel(h_ref, w_ref, tgt_ref, *out_refs, temperature, vocab_size, block_n,
                    block_v, block_d, d_blocks, v_blocks, blocks_per_split, with_entropy):
    i, split = pl.program_id(0), pl.program_id(1)
    rows = pl.ds(i * block_n, block_n)
    tgt = tgt_ref[rows, :]

    def body(step, stats):
        j = split * blocks_per_split + step
        # The last split may run past the (padded) vocab: read the last real block instead of
        # out-of-bounds memory; its column ids stay ≥ V, so the mask below drops it whole.
        z = _gpu_tile_logits(h_ref, w_ref, rows, jnp.minimum(j, v_blocks - 1) * block_v,
                             d_blocks=d_blocks, block_d=block_d, block_v=block_v,
                             temperature=temperature)
        col = _col_ids(j, block_v, z.shape)
        # Zero-padded W columns give z = 0 and must not enter the softmax.
        z = mask_logits(z, col, vocab_size)
        return update_stats(stats, z, col, tgt, with_entropy=with_entropy)

    stats = lax.fori_loop(0, blocks_per_split, body, init_stats((block_n, 1)))
    for ref, value in zip(out_refs, stats, strict=False):
        ref[...] = value


def _gpu_forward(hidden, lm_head, tgt, *, temperature, vocab_size, with_entropy, block_n,
                 block_v, block_d, vocab_splits, interpret):
    n_pad, d_pad = hidden.shape
    v_blocks = lm_head.shape[1] // block_v
    blocks_per_split = pl.cdiv(v_blocks, vocab_splits)
    splits = pl.cdiv(v_blocks, blocks_per_split)
    kernel = functools.partial(
        _gpu_fwd_kernel, temperature=temperature, vocab_size=vocab_size, block_n=block_n,
        block_v=block_v, block_d=block_d, d_blocks=d_pad // block_d, v_blocks=v_blocks,
        blocks_per_split=blocks_per_split, with_entropy=with_entropy)
    n_out = 4 if with_entropy else 3
    stats = pl.pallas_call(
        kernel,
        out_shape=[jax.ShapeDtypeStruct((splits, n_pad, 1), _F32)] * n_out,
        grid=(n_pad // block_n, splits),
        in_specs=[
            pl.BlockSpec(hidden.shape, lambda i, s: (0, 0)),
            pl.BlockSpec(lm_head.shape, lambda i, s: (0, 0)),
            pl.BlockSpec(tgt.shape, lambda i, s: (0, 0)),
        ],
        out_specs=[pl.BlockSpec((None, block_n, 1), lambda i, s: (s, i, 0))] * n_out,
        interpret=interpret,
        compiler_params=_gpu_params(interpret),
        name="token_logprobs_fwd_gpu",
    )(hidden, lm_head, tgt)
    if not with_entropy:
        stats = (*stats, jnp.zeros_like(stats[0]))
    return combine_stats(*stats)


def _gpu_bwd_kernel(h_ref, w_ref, tgt_ref, lse_ref, glp_ref, *rest, temperature, vocab_size,
                    block_n, block_v, block_d, d_blocks, with_entropy_grad):
    if with_entropy_grad:
        gh_ref, ent_ref, _, _, dh_ref, dw_ref = rest
    else:
        _, _, dh_ref, dw_ref = rest
    i, j = pl.program_id(0), pl.program_id(1)
    rows, cols = pl.ds(i * block_n, block_n), pl.ds(j * block_v, block_v)
    z = _gpu_tile_logits(h_ref, w_ref, rows, j * block_v, d_blocks=d_blocks, block_d=block_d,
                         block_v=block_v, temperature=temperature)
    col = _col_ids(j, block_v, z.shape)
    z = mask_logits(z, col, vocab_size)
    g_h = gh_ref[rows, :] if with_entropy_grad else None
    ent = ent_ref[rows, :] if with_entropy_grad else None
    dz = logit_cotangent(z, col, tgt_ref[rows, :], lse_ref[rows, :], glp_ref[rows, :], g_h, ent)
    dz = (dz / temperature).astype(h_ref.dtype)

    def scatter(k, carry):
        dk = _gpu_d_chunk(k, block_d)
        pltriton.atomic_add(dh_ref, (rows, dk), _dot_nt(dz, w_ref[dk, cols]))
        pltriton.atomic_add(dw_ref, (dk, cols), _dot_tn(h_ref[rows, dk], dz))
        return carry

    lax.fori_loop(0, d_blocks, scatter, 0)


def _gpu_backward(hidden, lm_head, tgt, lse, g_lp, g_h, ent, *, temperature, vocab_size,
                  block_n, block_v, block_d, interpret):
    n_pad, d_pad = hidden.shape
    v_pad = lm_head.shape[1]
    row_inputs = [tgt, lse, g_lp] + ([g_h, ent] if g_h is not None else [])
    inputs = [hidden, lm_head, *row_inputs,
              jnp.zeros((n_pad, d_pad), _F32), jnp.zeros((d_pad, v_pad), _F32)]
    kernel = functools.partial(
        _gpu_bwd_kernel, temperature=temperature, vocab_size=vocab_size, block_n=block_n,
        block_v=block_v, block_d=block_d, d_blocks=d_pad // block_d,
        with_entropy_grad=g_h is not None)
    n_in = len(inputs)
    dh, dw = pl.pallas_call(
        kernel,
        out_shape=[jax.ShapeDtypeStruct((n_pad, d_pad), _F32),
                   jax.ShapeDtypeStruct((d_pad, v_pad), _F32)],
        grid=(n_pad // block_n, v_pad // block_v),
        in_specs=[pl.BlockSpec(x.shape, lambda i, j: (0, 0)) for x in inputs],
        out_specs=[pl.BlockSpec((n_pad, d_pad), lambda i, j: (0, 0)),
                   pl.BlockSpec((d_pad, v_pad), lambda i, j: (0, 0))],
        # The zero-initialised fp32 buffers become the atomic accumulators.
        input_output_aliases={n_in - 2: 0, n_in - 1: 1},
        interpret=interpret,
        compiler_params=_gpu_params(interpret),
        name="token_logprobs_bwd_gpu",
    )(*inputs)
    return dh, dw


# ----------------------------------------------------------------------------- entry points


def _pad_to(x, shape):
    pads = [(0, want - have) for have, want in zip(x.shape, shape, strict=True)]
    return x if all(p == (0, 0) for p in pads) else jnp.pad(x, pads)


def _padded_inputs(hidden, lm_head, targets, *, family, block_n, block_v, block_d):
    n, d = hidden.shape
    v = lm_head.shape[1]
    n_pad = pl.cdiv(n, block_n) * block_n
    tgt = _pad_rows(targets.astype(jnp.int32)[:, None], n_pad)
    if family == "tpu":
        # Padded token rows are zeros: finite logits, and a zero cotangent in the backward, so
        # they add exactly 0 to dW. V stays ragged (masked in-kernel); W is never copied.
        return _pad_rows(hidden, n_pad), lm_head, tgt
    d_pad = pl.cdiv(d, block_d) * block_d
    v_pad = pl.cdiv(v, block_v) * block_v
    return _pad_to(hidden, (n_pad, d_pad)), _pad_to(lm_head, (d_pad, v_pad)), tgt


def pallas_forward(hidden, lm_head, targets, *, temperature, with_entropy, family, block_n,
                   block_v, block_d, vocab_splits, interpret):
    """``(logprobs [N], lse [N], entropy [N])`` in fp32 (entropy zeros if not asked)."""
    n, v = hidden.shape[0], lm_head.shape[1]
    h, w, tgt = _padded_inputs(hidden, lm_head, targets, family=family, block_n=block_n,
                               block_v=block_v, block_d=block_d)
    if family == "tpu":
        stats = _tpu_forward(h, w, tgt, temperature=temperature, with_entropy=with_entropy,
                             block_n=block_n, block_v=block_v, interpret=interpret)
    else:
        stats = _gpu_forward(h, w, tgt, temperature=temperature, vocab_size=v,
                             with_entropy=with_entropy, block_n=block_n, block_v=block_v,
                             block_d=block_d, vocab_splits=vocab_splits, interpret=interpret)
    logprobs, lse, entropy = finalize_stats(*stats)
    return logprobs[:n, 0], lse[:n, 0], entropy[:n, 0]


def pallas_backward(hidden, lm_head, targets, lse, g_lp, g_h, entropy, *, temperature, family,
                    block_n, block_v, block_d, interpret):
    """``(dh, dW)`` in the input dtypes, accumulated in fp32."""
    n, d = hidden.shape
    v = lm_head.shape[1]
    h, w, tgt = _padded_inputs(hidden, lm_head, targets, family=family, block_n=block_n,
                               block_v=block_v, block_d=block_d)
    n_pad = h.shape[0]

    def rows(x):
        # Padded rows get a zero cotangent, so their (finite) dz is exactly 0.
        return None if x is None else _pad_rows(x.astype(_F32)[:, None], n_pad)

    if family == "tpu":
        dh, dw = _tpu_backward(h, w, tgt, rows(lse), rows(g_lp), rows(g_h), rows(entropy),
                               temperature=temperature, block_n=block_n, block_v=block_v,
                               interpret=interpret)
    else:
        dh, dw = _gpu_backward(h, w, tgt, rows(lse), rows(g_lp), rows(g_h), rows(entropy),
                               temperature=temperature, vocab_size=v, block_n=block_n,
                               block_v=block_v, block_d=block_d, interpret=interpret)
    return dh[:n, :d].astype(hidden.dtype), dw[:d, :v].astype(lm_head.dtype)
