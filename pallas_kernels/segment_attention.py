"""Causal attention over packed rows, computing only what the rows' segments attend to.

For q [B, T, N, H], k/v [B, T, K, H] (grouped-query: head n reads kv head n // (N/K)) and
segment ids [B, T] (0 = padding; a packed row holds sequences 1, 2, ...):

    out[t] = Σ_{s ∈ A(t)} softmax_s(q_t·k_sᵀ/√H) · v_s,
    A(t)   = {s ≤ t : seg[s] = seg[t]}   if seg[t] ≠ 0,   ∅ (out = 0) for padding

Tree packing (``prefix_ids [B, T]``, 0 = none) widens A(t) by the query's shared prefix:
{s ≤ t : seg[s] = seg[t] or seg[s] = pre[t] ≠ 0}, so each of a group's continuations reads
the single copy of the group's prompt placed before them (``_segment_blocks``).

Softmax statistics are float32 in every implementation; the output has q's dtype.

Implementations (``impl``), all exact to the same formula:
  "reference"    dense masked attention over the whole row (T² pairs). The yardstick, and
                 what short rows use (≤ 2 blocks: nothing to skip).
  "blocksparse"  plain JAX, ``_blocksparse_attention``: a static list of (query block, key
                 block) pairs per row walked by a loop with a dynamic trip count, so a row
                 of short segments costs ≈ Σ Lₙ²/2 + T·block/2 pairs; custom VJP. CPU.
  "pallas"       the flash-attention kernel with segment ids (``_flash_attention_pallas``;
                 Triton layout, interpret mode on CPU), the same skip rule. GPU.
  "splash"       JAX's splash attention (``_splash_attention``; Mosaic layout, interpret
                 mode on CPU): a kept library kernel for TPU. It skips the causal mask's
                 blocks only; segments are masked inside the computed blocks.
  "cudnn"        cuDNN's packed (offsets and lengths) fused attention (``_cudnn_attention``;
                 NVIDIA Hopper or newer, bf16/fp16): a kept library kernel for GPU, which
                 ran 2–3.6× faster than "pallas" on a padded batch on an H200. Rows it
                 cannot express run "pallas". Not yet run on a GPU, so not "auto".
  "auto"         CPU → blocksparse, GPU → pallas, TPU → splash.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from pallas_kernels._blocksparse_attention import blocksparse_segment_attention
from pallas_kernels._cudnn_attention import cudnn_segment_attention
from pallas_kernels._flash_attention_pallas import pallas_segment_attention, triton_block
from pallas_kernels._per_shard import P, batch_spec, head_spec, per_shard
from pallas_kernels._same_bits import keeps_same_bits
from pallas_kernels._segment_blocks import needed_block_pairs, pad_to_blocks
from pallas_kernels._splash_attention import splash_segment_attention
from pallas_kernels._target import per_target

IMPLS = ("auto", "reference", "blocksparse", "pallas", "splash", "cudnn")
# Tokens per block of the block-sparse paths. 128 was the fastest at the tiny and 25m
# shapes on CPU (64 was within noise and doubles the loop's iterations).
BLOCK = 128


def resolve_attention_impl(impl: str, platform: str | None = None) -> str:
    """What "auto" means on `platform` (default: JAX's default backend); "cudnn" anywhere but
    on a GPU is an error."""
    if impl not in IMPLS:
        raise ValueError(f"unknown attention impl {impl!r}; expected one of {IMPLS}")
    platform = platform or jax.default_backend()
    if impl == "cudnn" and platform != "gpu":
        raise ValueError(f"attention_impl: 'cudnn' needs an NVIDIA GPU (JAX runs on "
                         f"{platform!r})")
    if impl != "auto":
        return impl
    return {"cpu": "blocksparse", "tpu": "splash"}.get(platform, "pallas")


def reference_segment_attention(q, k, v, segment_ids, prefix_ids=None) -> jax.Array:
    """Dense masked attention (module docstring's formula), zeros at padding queries."""
    length = q.shape[1]
    idx = jnp.arange(length)
    seg, keys = segment_ids[:, None, :, None], segment_ids[:, None, None, :]
    same = seg == keys
    if prefix_ids is not None:
        pre = prefix_ids[:, None, :, None]
        same = same | ((pre == keys) & (pre != 0))
    mask = (idx[:, None] >= idx[None, :])[None, None] & same
    out = jax.nn.dot_product_attention(q, k.astype(q.dtype), v.astype(q.dtype), mask=mask)
    return jnp.where((segment_ids > 0)[:, :, None, None], out, jnp.zeros((), out.dtype))


def runs_dense(impl: str, length: int, block: int | None = None, dtype=None) -> bool:
    """Whether `segment_attention` takes the dense path (and keeps T² scores for the
    backward): the reference, or rows of ≤ 2 blocks, where there is nothing to skip; but
    not block-sparse rows in low precision on CPU (`dtype`, `_same_bits.keeps_same_bits`),
    whose bits must be the sampler's blocked online softmax's."""
    if impl == "reference":
        return True
    if impl == "blocksparse" and dtype is not None and keeps_same_bits(dtype):
        return False
    return length <= 2 * (block or BLOCK)


def attention_block(impl: str, dtype, head_dim: int) -> int:
    """The block `segment_attention` uses by default: `triton_block` for the GPU kernel
    ("pallas" after resolving "auto", and "cudnn", whose fallback it is), else `BLOCK`."""
    return triton_block(dtype, head_dim) if impl in ("pallas", "cudnn") else BLOCK


def segment_attention(q, k, v, segment_ids, *, prefix_ids=None, impl: str = "auto",
                      block: int | None = None, dkdv_grid: str = "kv_heads") -> jax.Array:
    """Causal attention within segments (module docstring); `segment_ids` None = one
    sequence per row; `prefix_ids` the tree layout's shared prefixes (None = none);
    `block` defaults to `attention_block` (for "pallas", what fits a GPU's shared memory at
    q's dtype and head_dim); `dkdv_grid`: the "pallas" backward's dK/dV layout
    (`_flash_attention_pallas`; other impls ignore it)."""
    impl = resolve_attention_impl(impl)
    block = block or attention_block(impl, q.dtype, q.shape[-1])
    if segment_ids is None:
        segment_ids = jnp.ones(q.shape[:2], jnp.int32)
    if runs_dense(impl, q.shape[1], block, q.dtype):
        return reference_segment_attention(q, k, v, segment_ids, prefix_ids)
    if impl == "blocksparse":
        return blocksparse_segment_attention(q, k, v, segment_ids, prefix_ids, block=block)
    if prefix_ids is not None:
        return _tree_kernel(impl, q, k, v, segment_ids, prefix_ids, block, dkdv_grid)

    def run(interpret, q, k, v, segment_ids):
        if impl == "splash":
            return splash_segment_attention(q, k, v, segment_ids, interpret=interpret)
        return pallas_segment_attention(q, k, v, segment_ids, block_q=block, block_k=block,
                                        interpret=interpret, dkdv_grid=dkdv_grid)

    def kernel(q, k, v, segment_ids):
        # Interpret mode is chosen for the platform lowered for, not the default backend
        # (`_target`); cuDNN's own calls are not Pallas, its fallback (the GPU kernel) is.
        if impl == "cudnn":
            return cudnn_segment_attention(q, k, v, segment_ids, fallback=pallas)
        return pallas(q, k, v, segment_ids)

    def pallas(q, k, v, segment_ids):
        return per_target(run, q, k, v, segment_ids)

    return per_shard(kernel, lambda mesh: _row_specs(mesh, q, k))(q, k, v, segment_ids)


def _tree_kernel(impl, q, k, v, segment_ids, prefix_ids, block, dkdv_grid):
    """Tree-packed rows on the accelerator paths: the GPU kernel walks each query block's
    prefix and own key-block ranges; splash (TPU) takes the prefix ids too; cuDNN's packed
    layout (one offset and length per sequence) cannot say "and that prefix", so its rows
    run the GPU kernel, as the rows it cannot express already do."""

    def run(interpret, q, k, v, segment_ids, prefix_ids):
        if impl == "splash":
            return splash_segment_attention(q, k, v, segment_ids, prefix_ids=prefix_ids,
                                            interpret=interpret)
        return pallas_segment_attention(q, k, v, segment_ids, prefix_ids=prefix_ids,
                                        block_q=block, block_k=block, interpret=interpret,
                                        dkdv_grid=dkdv_grid)

    def kernel(*operands):  # interpret mode for the platform lowered for (`_target`)
        return per_target(run, *operands)

    def specs(mesh):
        (x, _, _, ids), out = _row_specs(mesh, q, k)
        return (x, x, x, ids, ids), out

    return per_shard(kernel, specs)(q, k, v, segment_ids, prefix_ids)


def _row_specs(mesh, q, k):
    """(in_specs, out_spec) of a kernel call on each device (`_per_shard`): rows over the
    batch axes, heads over the tensor axis, where they divide."""
    x = P(batch_spec(mesh, q.shape[0]), None, head_spec(mesh, q.shape[2], k.shape[2]), None)
    return (x, x, x, P(x[0], None)), x


def attended_block_pairs(segment_ids, block: int | None = None,
                         prefix_ids=None) -> tuple[int, int]:
    """(block pairs the block-sparse paths compute, block pairs of the causal triangle) for
    `segment_ids` [B, T] (and tree packing's `prefix_ids`), summed over rows: what a packed
    layout costs in attention."""
    block = block or BLOCK
    ids = pad_to_blocks(jnp.asarray(segment_ids, jnp.int32), block)
    if prefix_ids is not None:
        prefix_ids = pad_to_blocks(jnp.asarray(prefix_ids, jnp.int32), block)
    needed = int(jnp.sum(needed_block_pairs(ids, block, prefix=prefix_ids)))
    blocks = ids.shape[1] // block
    return needed, ids.shape[0] * blocks * (blocks + 1) // 2
