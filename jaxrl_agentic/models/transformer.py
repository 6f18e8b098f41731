"""Decoder-only transformer (Qwen2/Qwen2.5, Qwen3, Llama 3) in Flax NNX.

    h_0 = embed(tokens)
    h_l = h_{l-1} + Attn(RMSNorm(h_{l-1}));  h_l = h_l + MLP(RMSNorm(h_l))
    logits = RMSNorm(h_L) · W_out          (W_out = embedᵀ when tied)

Attention is grouped-query with RoPE (optionally q/k RMSNorm per head, Qwen3), the MLP is
SwiGLU: down(silu(gate(x)) · up(x)). Two entry points share every layer:

* `__call__` / `hidden_states`: the training forward over packed rows. `segment_ids`
  (0 = padding) make attention causal within a segment and blind across segments;
  `positions` restart at 0 per segment, so a packed row equals each sequence run alone.
  Attention computes only the (query block, key block) pairs the segments need
  (`pallas_kernels.segment_attention`), so a row of short samples costs about Σ len², not
  the row's length squared.
* `forward_with_cache`: the sampler's forward. New keys/values are written into a static
  `KVCache` at slot = position and each query attends to the slots ≤ its position; that is
  what lets a trajectory's cache be extended turn after turn without re-prefilling.

Norms, softmax, logits, the residual stream h_l and every projection's output are float32
whatever the compute dtype; only the matmuls' inputs (and attention with its KV cache) are in
it, as on an MXU or tensor core. Rounding each projection's output and each residual sum to
bf16 lets two programs that differ only in accumulation order (the sampler's one-token
decode, the learner's packed rows) drift apart layer after layer. On CPU the sampler's
cached attention also runs the learner's block-sparse algorithm (128-slot blocks, the shared
online-softmax update; `_cached_attention`), and in bf16 the two sides share
`pallas_kernels/_same_bits.py`'s measures, so their logprobs agree to float32 noise
(`docs/benchmarks.md`, "bf16 agreement"; `docs/notes/bf16_agreement.md`).
"""

from __future__ import annotations

import functools

import flax.struct
import jax
import jax.numpy as jnp
from flax import nnx

from jaxrl_agentic.models.config import ModelConfig
from jaxrl_agentic.models.dense_grad import projection_dot_general
from jaxrl_agentic.models.lora import lora_delta
from jaxrl_agentic.models.rope import apply_rope, rope_cos_sin, rope_frequencies
from pallas_kernels import fixed_order_sum, keeps_same_bits, online_softmax
from pallas_kernels.context_attention import context_segment_attention
from pallas_kernels.segment_attention import (
    BLOCK,
    resolve_attention_impl,
    runs_dense,
    segment_attention,
)

_INIT = nnx.initializers.normal(0.02)


@flax.struct.dataclass
class KVCache:
    """Per-layer keys [batch, num_kv_heads, head_dim, max_len] and values
    [batch, num_kv_heads, max_len, head_dim].

    Slot s of row b holds the token at position s of that row's stream. Heads come before
    slots so that attention reads each (row, kv head) as one contiguous matrix with no
    transposed copy per step. Keys are stored transposed (slots last) because both products
    are then plain [rows, contract] · [contract, cols] matmuls: q · K with K as [head_dim,
    slots] and p · V with V as [slots, head_dim]. With keys as [slots, head_dim] XLA:CPU runs
    the few-row decode product q · Kᵀ with its right operand contracted on the minor axis,
    several times slower (`docs/benchmarks.md`, "Sampler").
    """

    k: tuple[jax.Array, ...]
    v: tuple[jax.Array, ...]

    @classmethod
    def zeros(cls, cfg: ModelConfig, batch: int, max_len: int, dtype=None) -> KVCache:
        heads, dim = cfg.num_key_value_heads, cfg.head_dim
        dtype = dtype or jnp.dtype(cfg.dtype)
        layers = range(cfg.num_hidden_layers)
        return cls(
            k=tuple(jnp.zeros((batch, heads, dim, max_len), dtype) for _ in layers),
            v=tuple(jnp.zeros((batch, heads, max_len, dim), dtype) for _ in layers),
        )

    @property
    def max_len(self) -> int:
        return self.v[0].shape[2]

    def grow(self, max_len: int) -> KVCache:
        """The same cache with zero slots appended up to `max_len` (never shrinks)."""
        extra = max_len - self.max_len
        if extra <= 0:
            return self
        k_pad = ((0, 0), (0, 0), (0, 0), (0, extra))
        v_pad = ((0, 0), (0, 0), (0, extra), (0, 0))
        return KVCache(k=tuple(jnp.pad(a, k_pad) for a in self.k),
                       v=tuple(jnp.pad(a, v_pad) for a in self.v))


class RMSNorm(nnx.Module):
    """y = w · x / sqrt(mean(x²) + ε), statistics in float32 (as in HF checkpoints); in low
    precision on CPU Σ x² is summed in one order for any batch shape (`_same_bits`), so a
    decode's rows are normalised to the last bit as the learner's packed rows."""

    def __init__(self, dim: int, eps: float, *, dtype, param_dtype):
        self.scale = nnx.Param(jnp.ones((dim,), param_dtype))
        self.eps, self.dtype = eps, dtype

    def __call__(self, x):
        x32 = x.astype(jnp.float32)
        if keeps_same_bits(self.dtype):
            mean_sq = fixed_order_sum(x32 * x32)[..., None] / x.shape[-1]
        else:
            mean_sq = jnp.mean(x32 * x32, axis=-1, keepdims=True)
        normed = x32 * jax.lax.rsqrt(mean_sq + self.eps)
        return self.scale[...].astype(self.dtype) * normed.astype(self.dtype)


class Projection(nnx.Linear):
    """A linear layer that adds its low-rank adapter's output when it has one
    (``models/lora.py``; without one it is ``nnx.Linear``)."""

    def __call__(self, x):
        y = super().__call__(x)
        delta = lora_delta(x, self)
        return y if delta is None else y + delta


def _linear(cfg: ModelConfig, n_in: int, n_out: int, bias: bool, rngs: nnx.Rngs) -> Projection:
    return Projection(
        n_in,
        n_out,
        use_bias=bias,
        dtype=jnp.dtype(cfg.dtype),
        param_dtype=jnp.dtype(cfg.param_dtype),
        kernel_init=_INIT,
        # Accumulate and return float32 (the MXU/tensor-core contract): only the matmul's
        # inputs are rounded to the compute dtype, never its output (module docstring).
        preferred_element_type=jnp.float32,
        # The weight gradient without XLA:CPU's slow transposed writes (`dense_grad`).
        dot_general=projection_dot_general,
        rngs=rngs,
    )


class Attention(nnx.Module):
    def __init__(self, cfg: ModelConfig, rngs: nnx.Rngs):
        d, h = cfg.hidden_size, cfg.head_dim
        self.cfg = cfg
        self.q_proj = _linear(cfg, d, cfg.num_attention_heads * h, cfg.attention_bias, rngs)
        self.k_proj = _linear(cfg, d, cfg.num_key_value_heads * h, cfg.attention_bias, rngs)
        self.v_proj = _linear(cfg, d, cfg.num_key_value_heads * h, cfg.attention_bias, rngs)
        # Llama/Qwen3 put attention_bias on the output projection too; Qwen2 never does.
        o_bias = cfg.attention_bias and cfg.model_type != "qwen2"
        self.o_proj = _linear(cfg, cfg.num_attention_heads * h, d, o_bias, rngs)
        if cfg.qk_norm:
            dt, pdt = jnp.dtype(cfg.dtype), jnp.dtype(cfg.param_dtype)
            self.q_norm = RMSNorm(h, cfg.rms_norm_eps, dtype=dt, param_dtype=pdt)
            self.k_norm = RMSNorm(h, cfg.rms_norm_eps, dtype=dt, param_dtype=pdt)

    def __call__(self, x, cos, sin, mask, cache_kv=None, write_slots=None, cache_rows=None):
        """x [B, T, D]. Returns (out, (k, v)).

        Training forward: `mask` is a `PackedRows` (segment-aware causal attention over the
        row). With `cache_kv` (keys [C, K, H, S], values [C, K, S, H]), new keys/values are
        scattered to `write_slots` [B, T] (slots ≥ S are dropped: padding) and attention runs
        over the whole cache with `mask` [B, 1, T, keys]. Row b of x is cache row b, or
        `cache_rows[b]` when given ([B] indices; ≥ C: padding, never written).
        """
        b, t, _ = x.shape
        cfg = self.cfg
        q = self.q_proj(x).reshape(b, t, cfg.num_attention_heads, cfg.head_dim)
        k = self.k_proj(x).reshape(b, t, cfg.num_key_value_heads, cfg.head_dim)
        v = self.v_proj(x).reshape(b, t, cfg.num_key_value_heads, cfg.head_dim)
        if cfg.qk_norm:
            q, k = self.q_norm(q), self.k_norm(k)
        # Attention and the KV cache run in the compute dtype: both sides round q/k/v here.
        dt = jnp.dtype(cfg.dtype)
        q, k = apply_rope(q, cos, sin).astype(dt), apply_rope(k, cos, sin).astype(dt)
        v = v.astype(dt)
        if cache_kv is not None:
            k_cache, v_cache = cache_kv
            rows = (jnp.arange(b) if cache_rows is None else cache_rows)[:, None]
            # (rows, :, [:,] slots) indexing puts the index dims first: updates are
            # [B, T, K, H] for both layouts.
            k_cache = k_cache.at[rows, :, :, write_slots].set(k.astype(k_cache.dtype),
                                                              mode="drop")
            v_cache = v_cache.at[rows, :, write_slots].set(v.astype(v_cache.dtype), mode="drop")
            def attend(seen: int) -> jax.Array:
                k_seen, v_seen = k_cache[..., :seen], v_cache[:, :, :seen]
                if cache_rows is not None:  # only these rows' keys (padding rows: the last)
                    k_seen, v_seen = k_seen[cache_rows], v_seen[cache_rows]
                return _cached_attention(q, k_seen, v_seen, mask[..., :seen])

            # The mask says how many leading slots can be seen at all (see forward_with_cache).
            if isinstance(mask, CacheExtent):
                mask, extents, index = mask.mask, mask.extents, mask.index
                out = jax.lax.switch(index, [functools.partial(attend, e) for e in extents])
            else:
                out = attend(mask.shape[-1])
            return self.o_proj(out.reshape(b, t, -1)), (k_cache, v_cache)
        if mask.columns is not None:  # a row laid out for context parallelism
            out = context_segment_attention(q, k, v, mask.segment_ids, mask.columns,
                                            prefix_ids=mask.prefix_ids)
        else:
            out = segment_attention(q, k, v, mask.segment_ids, prefix_ids=mask.prefix_ids,
                                    impl=mask.attention_impl)
        return self.o_proj(out.reshape(b, t, -1)), (k, v)


def _cached_attention(q, k_t, v, mask):
    """Grouped-query softmax attention: q [B, T, N, H], keys transposed k_t [B, K, H, S],
    values v [B, K, S, H], mask [B, 1, T, S].

    Query heads are grouped per kv head ([B, K, G·T, H]) so keys and values are never
    repeated per head and both products are plain batched matmuls over (B, K) that read the
    cache in its own layout; logits and softmax are float32.

    Where the learner runs block-sparse attention (CPU), a cache of more than two blocks,
    or any cache in low precision, is read in blocks of `segment_attention.BLOCK` slots
    with the learner's own online-softmax update (:func:`_blocked_cached_attention`), so
    that in bf16 the sampler's attention output is the learner's to the last bit;
    elsewhere one softmax over the slots, as the learner's dense path computes rows of ≤
    two blocks (`runs_dense`).
    """
    impl = resolve_attention_impl("auto")
    if impl == "blocksparse" and not runs_dense(impl, k_t.shape[-1], dtype=q.dtype):
        return _blocked_cached_attention(q, k_t, v, mask, BLOCK)
    b, t, n, h = q.shape
    kv_heads, group = k_t.shape[1], n // k_t.shape[1]
    q = q.reshape(b, t, kv_heads, group, h).transpose(0, 2, 3, 1, 4)  # [B, K, G, T, H]
    q = q.reshape(b, kv_heads, group * t, h)
    logits = jnp.einsum("bkqh,bkhs->bkqs", q, k_t.astype(q.dtype),
                        preferred_element_type=jnp.float32)
    logits = logits.reshape(b, kv_heads, group, t, -1) * jnp.float32(h**-0.5)
    logits = jnp.where(mask[:, :, None], logits, jnp.finfo(jnp.float32).min)
    probs = jax.nn.softmax(logits, axis=-1).astype(q.dtype)
    probs = probs.reshape(b, kv_heads, group * t, -1)
    out = jnp.einsum("bkqs,bksh->bkqh", probs, v.astype(q.dtype))
    out = out.reshape(b, kv_heads, group, t, h).transpose(0, 3, 1, 2, 4)
    return out.reshape(b, t, n, h)


def _blocked_cached_attention(q, k_t, v, mask, block: int):
    """`_cached_attention` over blocks of `block` slots counted from slot 0, each folded in
    with `_online_softmax.update` in slot order: the computation the learner's block-sparse
    forward runs for a sample that starts at a multiple of `block` in its packed row. Slots
    past a query's position are masked, and a block with nothing attended leaves the state
    bit for bit as it was (α = 1, p = 0), so reading more slots than a stream holds changes
    nothing. A ragged last block is padded to `block` (masked) so every block has one shape."""
    b, t, n, h = q.shape
    kv_heads, group = k_t.shape[1], n // k_t.shape[1]
    q = q.reshape(b, t, kv_heads, group, h).transpose(0, 2, 3, 1, 4)  # [B, K, G, T, H]
    scale = h**-0.5  # as the learner's `_scores`
    mask = mask[:, :, None]  # [B, 1, 1, T, S]

    def fold(state, k_blk, v_blk, mask_blk):
        s = jnp.einsum("bkgqh,bkhs->bkgqs", q, k_blk.astype(q.dtype),
                       preferred_element_type=jnp.float32) * scale
        return online_softmax.update(
            *state, jnp.where(mask_blk, s, online_softmax.NEG), mask_blk,
            lambda probs: jnp.einsum("bkgqs,bksh->bkgqh", probs.astype(q.dtype),
                                     v_blk.astype(q.dtype), preferred_element_type=jnp.float32),
            fixed_order=keeps_same_bits(q.dtype))

    def fold_block(j, state):
        def cut(x, axis):
            return jax.lax.dynamic_slice_in_dim(x, j * block, block, axis)
        return fold(state, cut(k_t, 3), cut(v, 2), cut(mask, 4))

    slots = k_t.shape[-1]
    full, tail = divmod(slots, block)
    state = online_softmax.init_state(q.shape[:-1], q.shape)
    if full:  # (a zero-trip loop still traces its body: a block the cache does not hold)
        state = jax.lax.fori_loop(0, full, fold_block, state)
    if tail:
        def last(x, axis):
            x = jax.lax.slice_in_dim(x, full * block, slots, axis=axis)
            widths = [(0, 0)] * x.ndim
            widths[axis] = (0, block - tail)
            return jnp.pad(x, widths)
        state = fold(state, last(k_t, 3), last(v, 2), last(mask, 4))
    out, _ = online_softmax.finish(*state)
    return out.transpose(0, 3, 1, 2, 4).reshape(b, t, n, h).astype(q.dtype)


class MLP(nnx.Module):
    def __init__(self, cfg: ModelConfig, rngs: nnx.Rngs):
        d, f = cfg.hidden_size, cfg.intermediate_size
        self.gate_proj = _linear(cfg, d, f, cfg.mlp_bias, rngs)
        self.up_proj = _linear(cfg, d, f, cfg.mlp_bias, rngs)
        self.down_proj = _linear(cfg, f, d, cfg.mlp_bias, rngs)

    def __call__(self, x):
        return self.down_proj(jax.nn.silu(self.gate_proj(x)) * self.up_proj(x))


class Block(nnx.Module):
    def __init__(self, cfg: ModelConfig, rngs: nnx.Rngs):
        dt, pdt = jnp.dtype(cfg.dtype), jnp.dtype(cfg.param_dtype)
        self.input_norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, dtype=dt, param_dtype=pdt)
        self.attn = Attention(cfg, rngs)
        self.post_attn_norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, dtype=dt, param_dtype=pdt)
        self.mlp = MLP(cfg, rngs)

    def __call__(self, x, cos, sin, mask, cache_kv=None, write_slots=None, cache_rows=None):
        attn_out, kv = self.attn(self.input_norm(x), cos, sin, mask, cache_kv, write_slots,
                                 cache_rows)
        x = x + attn_out
        return x + self.mlp(self.post_attn_norm(x)), kv


@flax.struct.dataclass
class CacheExtent:
    """The sampler forward's mask [B, 1, T, S] over cache slots, read only up to a run-time
    choice among static extents: attention reads slots < `extents[index]` (`extents`
    ascending, every valid key below the chosen one). One program then serves every
    stream length of a fixed-size cache at the cost of the length it needs, where a
    static `key_len` compiles one program per length (continuous batching's fixed slot
    pool: `slot_decoder`)."""

    mask: jax.Array
    index: jax.Array
    extents: tuple[int, ...] = flax.struct.field(pytree_node=False, default=())


@flax.struct.dataclass
class PackedRows:
    """The training forward's attention mask, as segment ids [B, T] (0 = padding; None =
    one sequence per row): query t sees key s iff s ≤ t and both lie in the same nonzero
    segment, or (tree packing, `prefix_ids` [B, T]) s lies in the shared prefix t's segment
    continues; `attention_impl` picks the implementation (`pallas_kernels.segment_attention`:
    only the block pairs the segments need are computed). `columns` [B, T] (None = the
    tokens are in column order): each token's column in its packed row, for rows laid out
    for context parallelism (`pallas_kernels.context_attention`, which then computes the
    attention whatever `attention_impl`); causality is that of the columns."""

    segment_ids: jax.Array | None
    attention_impl: str = flax.struct.field(pytree_node=False, default="auto")
    prefix_ids: jax.Array | None = None
    columns: jax.Array | None = None


# Rematerialisation of the training forward (`Transformer.hidden_states(remat=...)`):
#   none   every activation is kept for the backward (fastest; memory ∝ layers · T²·heads)
#   layer  each block is recomputed in the backward; only the blocks' inputs [B, T, D] are
#          kept (≈ one extra forward; memory ∝ one block's activations + layers · T · D)
#   dots   each block keeps its matmul outputs without batch dims (the projections and
#          MLP, not the attention scores) and recomputes the rest
REMAT_POLICIES = {
    "none": None,
    "layer": jax.checkpoint_policies.nothing_saveable,
    "dots": jax.checkpoint_policies.dots_with_no_batch_dims_saveable,
}


def in_compute_dtype(weight: jax.Array, dtype, layer_dims: int = 0) -> jax.Array:
    """`weight` as the matmuls use it: a floating matrix wider than the compute `dtype` is
    cast to it (every projection and the LM head cast their matrix anyway, so storing it cast
    changes no value); vectors (norm scales, biases) and narrower arrays are returned as
    they are (the norms compute in fp32). `layer_dims`: leading axes that stack layers (1 for
    `Transformer.layers`' weights), not counted as matrix axes."""
    dtype = jnp.dtype(dtype)
    if weight.ndim - layer_dims >= 2 and jnp.issubdtype(weight.dtype, jnp.floating) \
            and weight.dtype.itemsize > dtype.itemsize:
        return weight.astype(dtype)
    return weight


@functools.partial(jax.custom_vjp, nondiff_argnums=(2,))
def tied_input_and_head(embedding, tokens, dtype):
    """(h_0 [..., D] float32, W_out = embeddingᵀ [D, V] in `dtype`) of a tied embedding: the
    values `Transformer.residual_input` and `lm_head_weight().astype(dtype)` give.

    Its backward writes the embedding's gradient as one expression of both cotangents,
        dE = scatter_add(0, tokens, dh_0) + dW_outᵀ,
    the values autodiff gives, in the same order. Left to autodiff, the two uses of E were
    differentiated apart, and XLA kept more [V, D]-sized buffers alive at once
    (``docs/benchmarks.md``, "Peak memory"; ``tests/training/test_update_memory.py``)."""
    return _tied_forward(embedding, tokens, dtype)


def _tied_forward(embedding, tokens, dtype):
    rows = jnp.take(embedding, tokens, axis=0)  # as nnx.Embed: out-of-range ids give NaN
    return rows.astype(dtype).astype(jnp.float32), embedding.T.astype(dtype)


def _tied_fwd(embedding, tokens, dtype):
    zero = jnp.zeros((), embedding.dtype)  # carries the parameter dtype to the backward
    return _tied_forward(embedding, tokens, dtype), (tokens, zero)


def _tied_bwd(dtype, residuals, cotangents):
    tokens, zero = residuals
    d_rows, d_head = cotangents
    dim = d_head.shape[0]
    # The cotangent passes back through both casts (float32 → dtype → parameter dtype).
    d_rows = d_rows.astype(dtype).astype(zero.dtype).reshape(-1, dim)
    d_embedding = jnp.zeros((d_head.shape[1], dim), zero.dtype).at[tokens.reshape(-1)].add(
        d_rows, mode="drop")
    return d_embedding + d_head.T.astype(zero.dtype), None


tied_input_and_head.defvjp(_tied_fwd, _tied_bwd)


def stack_blocks(blocks) -> Block:
    """One Block whose parameters are ``blocks``' stacked on a leading layer axis [L, ...]
    (``Transformer.layers``; ``Transformer.layer(i)`` takes block i back out)."""
    layer_def = nnx.split(blocks[0])[0]
    stacked = jax.tree.map(lambda *ws: jnp.stack(ws), *(nnx.split(b)[1] for b in blocks))
    return nnx.merge(layer_def, stacked)


class Transformer(nnx.Module):
    def __init__(self, cfg: ModelConfig, *, rngs: nnx.Rngs):
        self.cfg = cfg
        self.embed = nnx.Embed(
            cfg.vocab_size,
            cfg.hidden_size,
            dtype=jnp.dtype(cfg.dtype),
            param_dtype=jnp.dtype(cfg.param_dtype),
            embedding_init=_INIT,
            rngs=rngs,
        )
        # One Block whose every parameter carries a leading layer axis [L, ...]: the
        # training forward scans over it directly (`hidden_states`). Each block is
        # built as its own module first, so the initial values do not change.
        self.layers = stack_blocks([Block(cfg, rngs) for _ in range(cfg.num_hidden_layers)])
        dt, pdt = jnp.dtype(cfg.dtype), jnp.dtype(cfg.param_dtype)
        self.final_norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, dtype=dt, param_dtype=pdt)
        if not cfg.tie_word_embeddings:
            self.lm_head = _linear(cfg, cfg.hidden_size, cfg.vocab_size, False, rngs)
        inv_freq, scale = rope_frequencies(cfg)
        # Static python floats: NNX keeps them in the graph definition, not in the params.
        self._inv_freq, self._rope_scale = tuple(float(f) for f in inv_freq), scale

    # ---- shared pieces -------------------------------------------------------------------
    def layer(self, i: int) -> Block:
        """Block ``i`` as a module of its own (its slice of the stacked weights)."""
        layer_def, stacked = nnx.split(self.layers)
        return nnx.merge(layer_def, jax.tree.map(lambda w: w[i], stacked))

    def lm_head_weight(self) -> jax.Array:
        """The output projection as [D, V] (the embedding transposed when tied)."""
        if self.cfg.tie_word_embeddings:
            return self.embed.embedding[...].T
        return self.lm_head.kernel[...]

    def logits(self, hidden: jax.Array) -> jax.Array:
        """float32 logits [..., V] from final hidden states [..., D]."""
        w = self.lm_head_weight().astype(hidden.dtype)
        return jnp.dot(hidden, w, preferred_element_type=jnp.float32)

    def residual_input(self, tokens) -> jax.Array:
        """h_0: the embeddings (rounded to the compute dtype, as every matmul input is) in
        the float32 residual stream."""
        return self.embed(tokens).astype(jnp.float32)

    def _run_layers(self, tokens, positions, mask, cache=None, write_slots=None,
                    cache_rows=None, x0=None):
        x = self.residual_input(tokens) if x0 is None else x0
        cos, sin = rope_cos_sin(positions, self._inv_freq, self._rope_scale)
        new_k, new_v = [], []
        for i in range(self.cfg.num_hidden_layers):
            cache_kv = None if cache is None else (cache.k[i], cache.v[i])
            x, (k, v) = self.layer(i)(x, cos, sin, mask, cache_kv, write_slots, cache_rows)
            new_k.append(k)
            new_v.append(v)
        new_cache = None if cache is None else KVCache(k=tuple(new_k), v=tuple(new_v))
        return self.final_norm(x), new_cache

    # ---- training forward ----------------------------------------------------------------
    def hidden_states(self, tokens, positions, segment_ids=None, remat: str = "none",
                      attention_impl: str = "auto", x0=None, prefix_ids=None,
                      columns=None) -> jax.Array:
        """Final-normed hidden states [B, T, D] (the input of the LM head); `remat` one of
        `REMAT_POLICIES` (the same values and gradients, less memory, more compute);
        `attention_impl` one of `pallas_kernels.segment_attention.IMPLS`. Positions of
        padding (segment 0) attend to nothing: their hidden states are not the model's.
        `x0`: h_0 when the caller has it (`hidden_and_head`); `prefix_ids`: tree packing's
        shared prefixes, `columns`: a context-parallel row's columns (`PackedRows`)."""
        mask = PackedRows(segment_ids, attention_impl, prefix_ids, columns)
        x0 = self.residual_input(tokens) if x0 is None else x0
        if remat == "none":
            return self._run_layers(tokens, positions, mask, x0=x0)[0]
        if remat not in REMAT_POLICIES:
            raise ValueError(f"remat must be one of {', '.join(REMAT_POLICIES)}, got {remat!r}")

        # A scan over the layers' stacked weights, each step a checkpointed block: the
        # backward is then a reverse loop that recomputes one block at a time. Unrolled
        # checkpointed blocks were recomputed all at once by XLA:CPU's scheduler (the same
        # peak memory as no remat); the loop bounds it. The weights are stored stacked, so
        # the scan reads them where they are and its gradient is the parameters' gradient:
        # no stacked copy of the weights or of their gradient, which a list of blocks cost.
        # Each step casts its own layer to the compute dtype.
        layer_def, stacked = nnx.split(self.layers)
        cos, sin = rope_cos_sin(positions, self._inv_freq, self._rope_scale)

        @functools.partial(jax.checkpoint, policy=REMAT_POLICIES[remat])
        def block(x, weights):
            weights = jax.tree.map(lambda w: in_compute_dtype(w, self.cfg.dtype), weights)
            return nnx.merge(layer_def, weights)(x, cos, sin, mask)[0], None

        x, _ = jax.lax.scan(block, x0, stacked)
        return self.final_norm(x)

    def hidden_and_head(self, tokens, positions, segment_ids=None, remat: str = "none",
                        attention_impl: str = "auto", prefix_ids=None, columns=None
                        ) -> tuple[jax.Array, jax.Array]:
        """(`hidden_states(...)`, the output head [D, V] in the compute dtype): the training
        forward's two inputs of the LM-head kernel. The head is cast as the sampler (and
        `logits`) cast it; a tied embedding goes through `tied_input_and_head`, so its
        gradient takes one buffer."""
        dtype = jnp.dtype(self.cfg.dtype)
        if self.cfg.tie_word_embeddings:
            x0, head = tied_input_and_head(self.embed.embedding[...], tokens, dtype)
        else:
            x0, head = self.residual_input(tokens), self.lm_head_weight().astype(dtype)
        return self.hidden_states(tokens, positions, segment_ids, remat, attention_impl,
                                  x0, prefix_ids, columns), head

    def __call__(self, tokens, positions, segment_ids=None) -> jax.Array:
        """logits [B, T, V] in float32."""
        return self.logits(self.hidden_states(tokens, positions, segment_ids))

    # ---- sampler forward -----------------------------------------------------------------
    def forward_with_cache(self, tokens, positions, cache: KVCache, valid,
                           key_len: int | None = None, rows=None, extents=None,
                           key_index=None) -> tuple:
        """Runs `tokens` [B, T] at `positions` [B, T] against `cache`.

        Tokens with `valid` False (padding of ragged rows) are not written to the cache.
        Attention reads only the first `key_len` slots (static; default all): a caller that
        knows every valid position is below it skips the empty tail of a cache reserved
        ahead (a 64-token prompt in a 128-slot cache: half the prefill attention).
        `rows` [B] (optional) names the cache row of each input row, so a few rows of a big
        cache are run without computing the others (continuous batching's prefill).
        `extents` (static, ascending) with `key_index` (traced) choose the read length at run
        time instead (`CacheExtent`).
        Returns (hidden [B, T, D], updated cache).
        """
        slots = jnp.where(valid, positions, cache.max_len)  # out-of-range slots are dropped
        if extents is not None:  # key_len: extents[key_index] (see CacheExtent)
            key_len = extents[-1]
        key_slots = jnp.arange(cache.max_len if key_len is None else key_len)
        mask = (key_slots[None, None, None, :] <= positions[:, None, :, None])
        if extents is not None:
            mask = CacheExtent(mask, key_index, tuple(extents))
        return self._run_layers(tokens, positions, mask, cache, slots, rows)
