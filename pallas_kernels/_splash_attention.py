"""Causal attention within segments on TPU, through JAX's splash attention kernel.

Same contract as ``segment_attention.reference_segment_attention``: q [B, T, N, H], k/v
[B, T, K, H] (``N % K == 0``; query head n reads kv head ``n // (N/K)``), segment ids [B, T]
int32 (0 = padding; a packed row holds sequences 1, 2, ... as contiguous runs),

    out[t] = Σ_{s ∈ A(t)} softmax_s(q_t·k_sᵀ/√H) · v_s,
    A(t)   = {s ≤ t : seg[s] = seg[t]}   if seg[t] ≠ 0,   ∅ (out = 0) for padding,

softmax statistics in float32, output in q's dtype. Differentiable: splash has its own
custom VJP (FlashAttention-2 style dq and dk/dv kernels).

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
"""

from __future__ import annotations

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


def _kernel(num_heads: int, length: int, block: int, interpret: bool):
    """Splash MHA kernel for `num_heads` query heads, causal over `length` (a multiple of
    `block`), one block size for the forward and both backward kernels. Not cached here: its
    mask-info arrays are created with jnp and would be tracers when built under jit (the
    numpy block analysis behind them is lru-cached inside splash)."""
    mask = mask_lib.MultiHeadMask(
        [mask_lib.CausalMask((length, length)) for _ in range(num_heads)])
    sizes = splash.BlockSizes(
        block_q=block, block_kv=block, block_kv_compute=block,
        block_q_dkv=block, block_kv_dkv=block, block_kv_dkv_compute=block,
        block_q_dq=block, block_kv_dq=block)
    return splash.make_splash_mha(mask, block_sizes=sizes, head_shards=1, q_seq_shards=1,
                                  interpret=interpret)


def splash_segment_attention(q, k, v, segment_ids, *, block: int = 512,
                             interpret: bool = False) -> jax.Array:
    """Causal attention within segments (module docstring) via splash attention; `block`
    tokens per query/key block (rounded up to a multiple of 128, capped at the padded T);
    `interpret` runs the Pallas kernels in interpret mode (CPU tests)."""
    batch, length, num_heads, head_dim = q.shape
    num_kv = k.shape[2]
    if k.shape != (batch, length, num_kv, head_dim) or v.shape != k.shape:
        raise ValueError(f"k/v shapes {k.shape}, {v.shape} do not match q {q.shape}")
    if num_heads % num_kv:
        raise ValueError(f"query heads {num_heads} not a multiple of kv heads {num_kv}")
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

    kernel = _kernel(num_heads, padded_len, block, interpret)

    def one(q1, k1, v1, ids1):
        return kernel(q1, k1, v1, splash.SegmentIds(q=ids1, kv=ids1))

    out = jax.vmap(one)(q, k, v, ids)  # [B, N, T', H']
    out = out.transpose(0, 2, 1, 3)[:, :length, :, :head_dim]
    return jnp.where((segment_ids > 0)[:, :, None, None], out, jnp.zeros((), out.dtype))
