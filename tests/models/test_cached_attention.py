"""The sampler's cached attention: blocks of keys folded in with the learner's online-softmax
update, against attention written out in float64, and in bf16 bit-identical to the learner's
block-sparse forward for a sample that starts at a block boundary of its packed row (what
`PackingConfig.sample_align` arranges). That identity is what moved the bf16 sampler/learner
logprob gap of the 4-layer Qwen fixture from 3.8e-3 to 1.9e-3 (docs/notes/bf16_agreement.md)."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxrl_agentic.models.transformer import _blocked_cached_attention, _cached_attention
from pallas_kernels.segment_attention import blocksparse_segment_attention

HEADS, KV_HEADS, DIM = 4, 2, 16


def _cache_layout(k, v, slots):
    """[1, T, K, H] keys/values → the KV cache's layouts ([1, K, H, S], [1, K, S, H]),
    zeros past T."""
    t = k.shape[1]
    k_t = jnp.zeros((1, KV_HEADS, DIM, slots), k.dtype).at[..., :t].set(k.transpose(0, 2, 3, 1))
    v_c = jnp.zeros((1, KV_HEADS, slots, DIM), v.dtype).at[:, :, :t].set(v.transpose(0, 2, 1, 3))
    return k_t, v_c


def _attention_written_out(q, k, v, positions):
    """float64, one query at a time: query at `positions[i]` attends to keys 0..that."""
    q, k, v = (np.asarray(x, np.float64)[0] for x in (q, k, v))
    out = np.zeros_like(q)
    group = HEADS // KV_HEADS
    for i, p in enumerate(positions):
        for n in range(HEADS):
            logits = k[: p + 1, n // group] @ q[i, n] / np.sqrt(DIM)
            w = np.exp(logits - logits.max())
            out[i, n] = (w / w.sum()) @ v[: p + 1, n // group]
    return out


@pytest.mark.parametrize("slots,block", [(96, 32), (80, 32), (20, 32)])
def test_blocked_cached_attention_is_softmax_attention(slots, block):
    """Whole blocks, a ragged last block (80 = 2·32 + 16) and a cache shorter than a block;
    queries at the first slot, at block edges and at the last written slot."""
    rng = np.random.default_rng(0)
    length = min(slots, 70)
    k, v = (jnp.asarray(rng.normal(size=(1, length, KV_HEADS, DIM)), jnp.float32)
            for _ in range(2))
    positions = sorted({0, block - 1, block, length - 1} & set(range(length)))
    q = jnp.asarray(rng.normal(size=(1, len(positions), HEADS, DIM)), jnp.float32)
    k_t, v_c = _cache_layout(k, v, slots)
    mask = jnp.arange(slots)[None, None, None, :] <= jnp.asarray(positions)[None, None, :, None]
    out = jax.jit(_blocked_cached_attention, static_argnums=4)(q, k_t, v_c, mask, block)
    np.testing.assert_allclose(np.asarray(out)[0], _attention_written_out(q, k, v, positions),
                               atol=2e-5)


def test_bf16_cached_attention_is_the_learners_to_the_last_bit():
    """A 300-token sample at offset 0 of a 512-token row (a second sample after it, at 384):
    the prefill's and a one-token decode's attention outputs equal the learner's block-sparse
    forward bit for bit, for every query, in bf16."""
    rng = np.random.default_rng(1)
    length, row = 300, 512
    q, k, v = (jnp.asarray(rng.normal(size=(1, row, n, DIM)), jnp.bfloat16)
               for n in (HEADS, KV_HEADS, KV_HEADS))
    segments = np.zeros((1, row), np.int32)
    segments[0, :length], segments[0, 384:480] = 1, 2
    learner = np.asarray(jax.jit(blocksparse_segment_attention, static_argnames="block")(
        q, k, v, jnp.asarray(segments), block=128), np.float32)[0, :length]

    k_t, v_c = _cache_layout(k[:, :length], v[:, :length], row)
    attend = jax.jit(_blocked_cached_attention, static_argnums=4)
    slots = jnp.arange(row)
    prefill_mask = slots[None, None, None, :] <= jnp.arange(length)[None, None, :, None]
    # The model's cached attention on CPU (where the learner is block-sparse) is this one.
    prefill = np.asarray(jax.jit(_cached_attention)(q[:, :length], k_t, v_c, prefill_mask),
                         np.float32)[0]
    np.testing.assert_array_equal(prefill, learner)
    for t in (0, 127, 128, 255, 299):  # a decode step of 4 rows (the gemv of one row differs)
        rows = (4,) + k_t.shape[1:], (4,) + v_c.shape[1:]
        out = attend(jnp.broadcast_to(q[:, t:t + 1], (4, 1, HEADS, DIM)),
                     jnp.broadcast_to(k_t, rows[0]), jnp.broadcast_to(v_c, rows[1]),
                     jnp.broadcast_to(slots <= t, (4, 1, 1, row)), 128)
        np.testing.assert_array_equal(np.asarray(out, np.float32)[0, 0], learner[t])
