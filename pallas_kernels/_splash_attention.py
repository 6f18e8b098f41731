"""Causal attention within segments on TPU, through JAX's splash attention kernel.

Same contract as ``segment_attention.reference_segment_attention``: q [B, T, N, H], k/v
[B, T, K, H] (``N % K == 0``; query head n reads kv head ``n // (N/K)``), segment ids [B, T]
int32 (0 = padding; a packed row holds sequences 1, 2, ... as contiguous runs),

    out[t] = Σ_{s ∈ A(t)} softmax_s(q_t·k_sᵀ/√H) · v_s,
    A(t)   = {s ≤ t : seg[s] = seg[t]}   if seg[t] ≠ 0,   ∅ (out = 0) for padding,

softmax statistics in float32, output in q's dtype. Differentiable: splash has its own
custom VJP (FlashAttention-2 style dq and dk/dv kernels).

Tree packing (``prefix_ids`` pre [B, T], 0 = none) widens A(t) to
{s ≤ t : seg[s] = seg[t] or seg[s] = pre[t] ≠ 0}. Splash masks by id equality only
(``SegmentIds(q, kv)``: q_id[t] = kv_id[s]), and a prefix key must be seen by queries of
several ids (its own segment's and every continuation's) but not by each other, which no
single pair of id vectors expresses. A(t) is the disjoint union of two sets splash does
express, so the tree path runs two causal splash passes over the same inputs and merges them
as a split-key flash attention does:

    pass a: SegmentIds(q=seg, kv=seg)                          → O_a, lse_a
    pass b: SegmentIds(q=pre where 0 ≠ pre ≠ seg else −1, kv=seg) → O_b, lse_b
    lse = logaddexp(lse_a, lse_b),   O = Σ_p exp(lse_p − lse)·O_p.

(The sets are disjoint since pass b's query id is never the query's own id. A query with no
prefix attends nothing in pass b, where splash leaves l = the masked count and m = its mask
value ≈ −2.4e38, so exp(lse_b − lse) = 0 exactly.) Splash's forward can return
lse (``save_residuals``) but that output has no VJP, and O_p's own VJP misses the lse terms,
so the merge has its own custom VJP. The backward of attention over A(t) restricted to pass
p's pairs is splash's backward for pass p given the *merged* residuals: with P = exp(S − lse)
and D = rowsum(dO ⊙ O) of the whole attention, dS = P ⊙ (dO·Vᵀ − D) on p's pairs, which
is what splash's dq and dk/dv kernels compute from (q, k, v, ids_p, O, lse, dO). So the
backward calls splash's own backward rule (``splash_attention_kernel._splash_attention_bwd``,
a private function of the installed JAX) once per pass with (O, lse) and sums the two
(dq, dk, dv). Cost: twice the flat path's (both passes walk the causal triangle).

Why splash on TPU: it is a kept library kernel (``jax.experimental.pallas.ops.tpu``) written
for Mosaic's layout (8 × 128 tiles, scalar-prefetched block schedules). This repo's own Pallas
flash kernel (``_flash_attention_pallas``) is written in the Triton style for GPU.

What is skipped: splash skips only the block pairs its *static* mask rules out, here the
causal mask (``CausalMask``; key blocks strictly after the query block). Segment ids are not
used to skip anything: inside every computed block pair they are applied as an elementwise
mask (``q_id == kv_id``). So a row of short segments costs the whole causal triangle
(≈ nq²/2 block pairs), unlike ``_blocksparse_attention`` / ``_flash_attention_pallas``,
which also skip the pairs no segment spans.

How the wrapper maps the contract onto splash (checked against the installed
``splash_attention_kernel``):
  * layout: splash works on one example, q [N, T, H] and k/v [K, T, H]; the batch is
    ``vmap``-ed. Its MHA kernel accepts ``K`` dividing ``N`` and maps query head h to kv head
    ``h // (N/K)`` (forward, dq and dkv index maps), which is this repo's GQA rule, so
    ``make_splash_mha`` is used directly (no per-kv-head MQA loop).
  * scale: splash does not scale q (its logits are ``q·kᵀ``); q is multiplied by ``H^-½``
    of the *real* head dim before the call (the chain rule carries it into dq).
  * sequence: block sizes must be multiples of 128 (the kernel raises otherwise) and divide
    T; ``block`` is rounded up to a multiple of 128 and capped at T rounded up to 128, and T
    is padded to a multiple of it with segment id 0, then the output is cut back.
  * head dim: padded with zeros to a multiple of 128 (dot products unchanged; padded output
    columns are sliced off). Every block spec covers the whole head dim, so smaller H may
    well lower, but 128 and 256 are the only head dims JAX's own splash tests cover.
  * padding queries: splash lets a seg-0 query attend to earlier seg-0 keys (never an empty
    row: causal self-attention always keeps the diagonal), so their output is replaced by 0
    with ``jnp.where``, which also gives them zero gradient.
  * prefix ids: padded like the segment ids (0 = none); the tree path's id for "no prefix"
    is −1, which no key has (key ids are ≥ 0).
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax.experimental.pallas.ops.tpu.splash_attention import (
    splash_attention_kernel as splash,
)
from jax.experimental.pallas.ops.tpu.splash_attention import (
    splash_attention_mask as mask_lib,
)

from pallas_kernels._shapes import round_up

_LANES = 128  # splash's NUM_LANES: block sizes and (here) the head dim are multiples of it


def _kernel(num_heads: int, length: int, block: int, interpret: bool,
            save_residuals: bool = False):
    """Splash MHA kernel for `num_heads` query heads, causal over `length` (a multiple of
    `block`), one block size for the forward and both backward kernels; `save_residuals`
    makes it return ``(out, (lse,))`` (not differentiable). Not cached here: its
    mask-info arrays are created with jnp and would be tracers when built under jit (the
    numpy block analysis behind them is lru-cached inside splash)."""
    mask = mask_lib.MultiHeadMask(
        [mask_lib.CausalMask((length, length)) for _ in range(num_heads)])
    sizes = splash.BlockSizes(
        block_q=block, block_kv=block, block_kv_compute=block,
        block_q_dkv=block, block_kv_dkv=block, block_kv_dkv_compute=block,
        block_q_dq=block, block_kv_dq=block)
    return splash.make_splash_mha(mask, block_sizes=sizes, head_shards=1, q_seq_shards=1,
                                  save_residuals=save_residuals, interpret=interpret)


# ----------------------------------------------------------------------------- tree packing


_NO_PREFIX = -1  # pass b's query id for queries without a prefix: no key has it


def _pass_ids(seg, pre):
    """The two passes' ``SegmentIds`` of one example (module docstring): own segment, then
    the prefix segment. A prefix id equal to the query's own id adds no key; pass b gives
    such a query no prefix, so the two passes' key sets stay disjoint."""
    prefix = jnp.where((pre != 0) & (pre != seg), pre, _NO_PREFIX)
    return splash.SegmentIds(q=seg, kv=seg), splash.SegmentIds(q=prefix, kv=seg)


def _merge(outs, lses):
    """``O = Σ_p exp(lse_p − lse)·O_p`` (float32) and ``lse = log Σ_p exp lse_p``."""
    lse = functools.reduce(jnp.logaddexp, lses)
    out = sum(jnp.exp(l - lse)[..., None] * o.astype(jnp.float32)
              for o, l in zip(outs, lses, strict=True))
    return out, lse


@functools.partial(jax.custom_vjp, nondiff_argnums=(5, 6))
def _tree_attention(q, k, v, seg, pre, block, interpret):
    """One example: q [N, T, H], k/v [K, T, H] (already scaled, padded), ids [T]."""
    return _tree_attention_fwd(q, k, v, seg, pre, block, interpret)[0]


def _tree_attention_fwd(q, k, v, seg, pre, block, interpret):
    kernel = _kernel(q.shape[0], q.shape[1], block, interpret, save_residuals=True)
    passes = [kernel(q, k, v, ids) for ids in _pass_ids(seg, pre)]
    out, lse = _merge([o for o, _ in passes], [r[0] for _, r in passes])
    out = out.astype(q.dtype)
    return out, (q, k, v, seg, pre, out, lse)


def _tree_attention_bwd(block, interpret, res, do):
    q, k, v, seg, pre, out, lse = res
    kernel = _kernel(q.shape[0], q.shape[1], block, interpret)
    grads = [_splash_backward(kernel, q, k, v, ids, out, lse, do)
             for ids in _pass_ids(seg, pre)]
    dq, dk, dv = (sum(g.astype(jnp.float32) for g in gs).astype(x.dtype)
                  for gs, x in zip(zip(*grads, strict=True), (q, k, v), strict=True))
    return dq, dk, dv, None, None


_tree_attention.defvjp(_tree_attention_fwd, _tree_attention_bwd)


def _splash_backward(kernel, q, k, v, ids, out, lse, do):
    """(dq, dk, dv) of one pass from splash's backward rule with the merged (out, lse) as
    its residuals: the pass's share of the gradient of the merged attention."""
    kw = kernel.kwargs
    res = (q, k, v, ids, None, out, lse, kernel.dq_mask_info, kernel.dkv_mask_info)
    grads = splash._splash_attention_bwd(
        save_residuals=False, mask_value=kw["mask_value"], is_mqa=kw["is_mqa"],
        block_sizes=kw["block_sizes"], residual_checkpoint_name=None,
        mask_function=kw["mask_function"], attn_logits_soft_cap=kw["attn_logits_soft_cap"],
        interpret=kw["interpret"], res=res, do=do)
    return grads[3:6]  # the cotangents of (q, k, v) among (mask infos ×3, q, k, v, ids, sinks)


# ----------------------------------------------------------------------------- entry point


def splash_segment_attention(q, k, v, segment_ids, *, prefix_ids=None, block: int = 512,
                             interpret: bool = False) -> jax.Array:
    """Causal attention within segments (module docstring) via splash attention; with
    `prefix_ids` the tree layout's two merged passes; `block` tokens per query/key block
    (rounded up to a multiple of 128, capped at the padded T); `interpret` runs the Pallas
    kernels in interpret mode (CPU tests)."""
    batch, length, num_heads, head_dim = q.shape
    num_kv = k.shape[2]
    if k.shape != (batch, length, num_kv, head_dim) or v.shape != k.shape:
        raise ValueError(f"k/v shapes {k.shape}, {v.shape} do not match q {q.shape}")
    if num_heads % num_kv:
        raise ValueError(f"query heads {num_heads} not a multiple of kv heads {num_kv}")
    if prefix_ids is not None and prefix_ids.shape != segment_ids.shape:
        raise ValueError(f"prefix_ids shape {prefix_ids.shape} != {segment_ids.shape}")
    if block < 1:
        raise ValueError(f"block must be positive, got {block}")
    block = min(round_up(block, _LANES), round_up(length, _LANES))
    padded_len = round_up(length, block)
    padded_dim = round_up(head_dim, _LANES)

    dtype = q.dtype
    scale = head_dim ** -0.5
    q = (q.astype(jnp.float32) * scale).astype(dtype)
    k, v = k.astype(dtype), v.astype(dtype)
    pad = ((0, 0), (0, padded_len - length), (0, 0), (0, padded_dim - head_dim))
    # [B, T, heads, H] -> [B, heads, T', H']
    q, k, v = (jnp.pad(x, pad).transpose(0, 2, 1, 3) for x in (q, k, v))
    ids = jnp.pad(segment_ids.astype(jnp.int32), ((0, 0), (0, padded_len - length)))

    if prefix_ids is None:
        kernel = _kernel(num_heads, padded_len, block, interpret)

        def one(q1, k1, v1, ids1):
            return kernel(q1, k1, v1, splash.SegmentIds(q=ids1, kv=ids1))

        out = jax.vmap(one)(q, k, v, ids)  # [B, N, T', H']
    else:
        pre = jnp.pad(prefix_ids.astype(jnp.int32), ((0, 0), (0, padded_len - length)))
        out = jax.vmap(lambda *x: _tree_attention(*x, block, interpret))(q, k, v, ids, pre)
    out = out.transpose(0, 2, 1, 3)[:, :length, :, :head_dim]
    return jnp.where((segment_ids > 0)[:, :, None, None], out, jnp.zeros((), out.dtype))
