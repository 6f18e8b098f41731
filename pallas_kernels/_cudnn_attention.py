"""Causal attention within segments on an NVIDIA GPU, through cuDNN's packed flash attention.

Same contract as ``segment_attention.reference_segment_attention``: q [B, T, N, H], k/v
[B, T, K, H] (``N % K == 0``; query head n reads kv head ``n // (N/K)``), segment ids [B, T]
int32 (0 = padding),

    out[t] = Σ_{s ∈ A(t)} softmax_s(q_t·k_sᵀ/√H) · v_s,
    A(t)   = {s ≤ t : seg[s] = seg[t]}   if seg[t] ≠ 0,   ∅ (out = 0) for padding.

Why cuDNN: on an H200 its fused attention ran a padded batch of the same samples 2–3.6×
faster than this repository's Triton-layout kernel with the backward (``docs/benchmarks.md``,
"On a GPU"). cuDNN's packed ("THD") layout takes a row as segments given by start offsets and
lengths, so it computes only what the segments attend to, as the block-skipping kernels do,
and needs no padded copy. JAX reaches it through
``jax._src.cudnn.fused_attention_stablehlo.dot_product_attention`` (``q_offsets``/
``q_seqlen``): a private module, since ``jax.nn.dot_product_attention`` does not take offsets.
It needs a Hopper or newer GPU, bf16 or fp16 inputs and a head dim that is a multiple of 8.

Segment ids to (offsets, lengths), per row: a *run* is a maximal stretch of equal nonzero
ids; its start, length and id are read off the row (``segment_runs``). The row is
expressible when it has at most ``max_segments`` runs and the runs' ids strictly increase
along the row: then every id is exactly one run, and the runs are the segments. Packed rows
(``data.packing``) always are. Any other row (more runs than the static bound, an id that
comes back after another one) cannot be given to cuDNN without changing the function, so
the whole call then takes ``fallback`` instead (a ``lax.cond`` on the rows' data: exact
either way, both compiled once); so does a call whose rows are all padding.

Padding positions belong to no segment; their output is set to 0 with ``jnp.where`` (which
also stops any gradient there), whatever cuDNN leaves in them.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

# Runs per row cuDNN is given room for. cuDNN keeps softmax statistics of shape
# [B · max_segments, N, T] in float32 for the backward (14.7 MB per layer for a 4,096-token
# Qwen2.5-0.5B row at 64), so the bound is static and modest; rows with more runs fall back.
MAX_SEGMENTS = 64
_HALF_DTYPES = (jnp.bfloat16, jnp.float16)


def segment_runs(segment_ids, max_segments: int):
    """Per row of ``segment_ids [B, T]``: ``(offsets [B, M + 1], lengths [B, M], expressible
    [B])`` int32 / bool with ``M = max_segments``. ``offsets[:, r]`` is the start of run r
    and ``lengths[:, r]`` its length, -1 past the row's runs (and always in the last offset
    column), as cuDNN's packed layout wants them; ``expressible`` as the module docstring."""
    seg = segment_ids.astype(jnp.int32)
    rows, length = seg.shape
    before = jnp.pad(seg[:, :-1], ((0, 0), (1, 0)))  # 0 before the first token
    after = jnp.pad(seg[:, 1:], ((0, 0), (0, 1)))  # 0 after the last one
    is_start = (seg != 0) & (seg != before)
    is_end = (seg != 0) & (seg != after)

    def positions(flags):
        return jax.vmap(lambda f: jnp.nonzero(f, size=max_segments, fill_value=-1)[0])(flags)

    starts, ends = positions(is_start), positions(is_end)
    present = starts >= 0
    lengths = jnp.where(present, ends - starts + 1, -1).astype(jnp.int32)
    ids = jnp.where(present, jnp.take_along_axis(seg, jnp.maximum(starts, 0), axis=1), 0)
    increasing = jnp.all((ids[:, 1:] > ids[:, :-1]) | ~present[:, 1:], axis=1)
    expressible = (jnp.sum(is_start, axis=1) <= max_segments) & increasing
    offsets = jnp.concatenate([starts, jnp.full((rows, 1), -1, starts.dtype)], axis=1)
    return offsets.astype(jnp.int32), lengths, expressible


def takes_packed_path(lengths, expressible) -> jax.Array:
    """Whether a call goes to cuDNN: every row expressible, and at least one segment in the
    call (a call of padding rows only would hand cuDNN zero sequences, which its packed
    layout is not documented to accept)."""
    return jnp.all(expressible) & jnp.any(lengths > 0)


def cudnn_packed_attention(q, k, v, offsets, lengths):
    """cuDNN's causal attention over the packed segments ``offsets``/``lengths``
    (``segment_runs``), scale ``H^-½``. Positions outside every segment are left as cuDNN
    leaves them."""
    try:
        from jax._src.cudnn import fused_attention_stablehlo as cudnn
    except ImportError as e:  # a JAX without the module: say which, not a stack trace
        raise RuntimeError(f"attention_impl='cudnn': this JAX ({jax.__version__}) has no "
                           f"jax._src.cudnn.fused_attention_stablehlo ({e})") from e
    return cudnn.dot_product_attention(
        q, k, v, q_seqlen=lengths, kv_seqlen=lengths, q_offsets=offsets, kv_offsets=offsets,
        scale=q.shape[-1] ** -0.5, mask_type=cudnn.MaskType.PADDING_CAUSAL,
        qkv_layout="BTNH")


def cudnn_segment_attention(q, k, v, segment_ids, *, fallback, max_segments: int = MAX_SEGMENTS,
                            packed_attention=cudnn_packed_attention):
    """Causal attention within segments (module docstring) through ``packed_attention``
    (default cuDNN) when every row is expressible, else ``fallback(q, k, v, segment_ids)``.
    ``packed_attention(q, k, v, offsets, lengths)`` is a parameter so the conversion and the
    fallback can be checked where cuDNN does not run."""
    if q.dtype not in _HALF_DTYPES:
        raise ValueError(f"attention_impl='cudnn' needs bfloat16 or float16 q, k, v (cuDNN's "
                         f"fused attention has no float32 path), got {q.dtype}")
    if q.shape[-1] % 8:
        raise ValueError(f"attention_impl='cudnn' needs a head dim that is a multiple of 8, "
                         f"got {q.shape[-1]}")
    segment_ids = segment_ids.astype(jnp.int32)
    offsets, lengths, expressible = segment_runs(segment_ids, max_segments)

    def packed(q, k, v, segment_ids):
        out = packed_attention(q, k, v, offsets, lengths)
        return jnp.where((segment_ids > 0)[:, :, None, None], out, jnp.zeros((), out.dtype))

    return jax.lax.cond(takes_packed_path(lengths, expressible), packed, fallback, q, k, v,
                        segment_ids)
