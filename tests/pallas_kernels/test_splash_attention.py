"""splash_segment_attention (JAX's TPU splash kernel, interpret mode on CPU) against the dense
reference: outputs and q/k/v gradients at non-padding queries, exact zeros at padding."""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.experimental.pallas.ops.tpu.splash_attention import (
    splash_attention_kernel as splash,
)
from jax.experimental.pallas.ops.tpu.splash_attention import (
    splash_attention_mask as mask_lib,
)

from pallas_kernels._splash_attention import splash_segment_attention
from pallas_kernels.segment_attention import reference_segment_attention
from tests.pallas_kernels.attention_cases import packed_row, tree_batch

TOL = 1e-5  # fp32, relative to max |reference|

# (T, N, K, H, rows): T pads to a multiple of 128 in both; segments cross the 128/256 block
# edges; row 2 has trailing padding, or is all padding.
CASES = [
    pytest.param(200, 4, 2, 32, ([100, 60, 40], [150]), id="gqa-T200-trailing-pad"),
    pytest.param(300, 2, 2, 64, ([130, 90, 30, 50], []), id="mha-T300-empty-row"),
]


def _inputs(length, heads, kv_heads, dim, rows, seed=0):
    rng = np.random.default_rng(seed)
    q = rng.normal(size=(len(rows), length, heads, dim))
    k = rng.normal(size=(len(rows), length, kv_heads, dim))
    v = rng.normal(size=(len(rows), length, kv_heads, dim))
    seg = np.stack([packed_row(lengths, length) for lengths in rows])
    return (*(jnp.asarray(x, jnp.float32) for x in (q, k, v)), jnp.asarray(seg))


def _rel_err(x, ref):
    return float(jnp.max(jnp.abs(x - ref)) / jnp.max(jnp.abs(ref)))


@pytest.mark.parametrize("length,heads,kv_heads,dim,rows", CASES)
def test_matches_reference_outputs_and_grads(length, heads, kv_heads, dim, rows):
    q, k, v, seg = _inputs(length, heads, kv_heads, dim, rows)
    real = (seg > 0)[:, :, None, None]
    weights = jnp.asarray(np.random.default_rng(1).normal(size=q.shape), jnp.float32)
    splash_fn = functools.partial(splash_segment_attention, block=128, interpret=True)

    def loss(fn, where, q, k, v):  # a random linear functional of the outputs at `where`
        out = fn(q, k, v, seg)
        return jnp.sum(jnp.where(where, out * weights, 0.0)), out

    grad = jax.value_and_grad(loss, argnums=(2, 3, 4), has_aux=True)
    (_, out), grads = jax.jit(functools.partial(grad, splash_fn, real))(q, k, v)
    (_, ref), ref_grads = grad(reference_segment_attention, real, q, k, v)
    # Padding queries pass no gradient anywhere.
    _, pad_grads = jax.jit(functools.partial(grad, splash_fn, ~real))(q, k, v)
    assert all(np.all(np.asarray(g) == 0.0) for g in pad_grads)

    assert out.shape == q.shape and out.dtype == q.dtype
    assert _rel_err(jnp.where(real, out, 0.0), ref) < TOL
    assert np.all(np.asarray(out)[~np.asarray(seg > 0)] == 0.0)
    for name, g, g_ref in zip("qkv", grads, ref_grads, strict=True):
        assert g.shape == g_ref.shape
        assert _rel_err(g, g_ref) < TOL, name


def test_default_block_is_capped_at_padded_length():
    # block=512 > T=200: one 256-token block (T rounded up to 128), same result.
    q, k, v, seg = _inputs(200, 4, 2, 32, ([100, 60, 40], [150]), seed=2)
    out = jax.jit(functools.partial(splash_segment_attention, interpret=True))(q, k, v, seg)
    ref = reference_segment_attention(q, k, v, seg)
    assert _rel_err(out, ref) < TOL


def test_splash_kernel_does_not_scale_q():
    # The wrapper multiplies q by H^-1/2 because the installed kernel's logits are plain q.k.
    length, dim = 128, 32
    rng = np.random.default_rng(3)
    q, k, v = (jnp.asarray(rng.normal(size=s), jnp.float32)
               for s in ((1, length, dim), (1, length, dim), (1, length, dim)))
    mask = mask_lib.MultiHeadMask([mask_lib.CausalMask((length, length))])
    sizes = splash.BlockSizes(block_q=128, block_kv=128, block_kv_compute=128)
    kernel = splash.make_splash_mha(mask, block_sizes=sizes, head_shards=1, q_seq_shards=1,
                                    interpret=True)
    out = kernel(q, k, v)
    causal = jnp.tril(jnp.ones((length, length), bool))
    logits = jnp.where(causal, jnp.einsum("htd,hsd->hts", q, k), -jnp.inf)
    unscaled = jnp.einsum("hts,hsd->htd", jax.nn.softmax(logits, axis=-1), v)
    assert _rel_err(out, unscaled) < TOL


@pytest.mark.parametrize("block", [128])
def test_tree_rows_match_reference_outputs_and_grads(block):
    """Prefix ids (two merged splash passes, own segment and prefix, with their own VJP):
    values and q/k/v gradients against the dense reference with the same prefix ids, on
    rows with long and short prefixes, a prefix without members and flat segments only."""
    seg, pre = (jnp.asarray(x) for x in tree_batch())
    rng = np.random.default_rng(4)
    q, k, v = (jnp.asarray(rng.normal(size=(*seg.shape, heads, 32)), jnp.float32)
               for heads in (4, 2, 2))
    real = (seg > 0)[:, :, None, None]
    weights = jnp.asarray(rng.normal(size=q.shape), jnp.float32)

    def splash_fn(q, k, v):
        return splash_segment_attention(q, k, v, seg, prefix_ids=pre, block=block,
                                        interpret=True)

    def reference(q, k, v):
        return reference_segment_attention(q, k, v, seg, pre)

    def loss(fn, q, k, v):
        out = fn(q, k, v)
        return jnp.sum(jnp.where(real, out * weights, 0.0)), out

    grad = jax.value_and_grad(loss, argnums=(1, 2, 3), has_aux=True)
    (_, out), grads = jax.jit(functools.partial(grad, splash_fn))(q, k, v)
    (_, ref), ref_grads = grad(reference, q, k, v)

    assert out.shape == q.shape and out.dtype == q.dtype
    assert np.all(np.asarray(out)[~np.asarray(seg > 0)] == 0.0)
    assert _rel_err(out, ref) < TOL
    for name, g, g_ref in zip("qkv", grads, ref_grads, strict=True):
        assert _rel_err(g, g_ref) < TOL, name


def test_tree_pass_split_is_exact_for_arbitrary_prefix_ids():
    """Scattered ids and prefix ids, some equal to the query's own id and some naming later
    segments: the two passes still give the reference's attention."""
    rng = np.random.default_rng(5)
    seg = jnp.asarray(rng.integers(0, 4, size=(1, 128)), jnp.int32)
    pre = jnp.asarray(rng.integers(0, 4, size=(1, 128)), jnp.int32)
    q, k, v = (jnp.asarray(rng.normal(size=(1, 128, 2, 32)), jnp.float32) for _ in range(3))
    weights = jnp.asarray(rng.normal(size=q.shape), jnp.float32)

    def loss(fn, q, k, v):
        return jnp.sum(fn(q, k, v, seg, prefix_ids=pre) * weights)

    splash_fn = functools.partial(splash_segment_attention, block=128, interpret=True)
    grads = jax.jit(jax.grad(functools.partial(loss, splash_fn), argnums=(0, 1, 2)))(q, k, v)
    ref_grads = jax.grad(functools.partial(loss, reference_segment_attention),
                         argnums=(0, 1, 2))(q, k, v)
    out = splash_fn(q, k, v, seg, prefix_ids=pre)
    assert _rel_err(out, reference_segment_attention(q, k, v, seg, pre)) < TOL
    for name, g, g_ref in zip("qkv", grads, ref_grads, strict=True):
        assert _rel_err(g, g_ref) < TOL, name
