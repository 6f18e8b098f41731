"""Segment-aware attention: the block-sparse path against dense masked attention (values and
gradients), and the block pairs it computes against a brute-force count."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from pallas_kernels._blocksparse_attention import _pair_list
from pallas_kernels._segment_blocks import needed_block_pairs
from pallas_kernels.segment_attention import (
    attended_block_pairs,
    blocksparse_segment_attention,
    reference_segment_attention,
    resolve_attention_impl,
    segment_attention,
)
from tests.pallas_kernels.attention_cases import (
    packed_row,
    token_level_needed,
    tree_attention_written_out,
    tree_batch,
    tree_token_mask,
)


def _packed_ids(lengths_per_row, row_len):
    return np.stack([packed_row(lengths, row_len) for lengths in lengths_per_row])


def _qkv(rng, rows, length, heads, kv_heads, dim, dtype):
    def draw(n):
        return jnp.asarray(rng.normal(size=(rows, length, n, dim)), dtype)
    return draw(heads), draw(kv_heads), draw(kv_heads)


def _dense_mask_dense_numpy(q, k, v, ids):
    """Attention written out in numpy float64, one query at a time: the independent
    reference for the reference itself."""
    q, k, v = (np.asarray(x, np.float64) for x in (q, k, v))
    rows, length, heads, dim = q.shape
    group = heads // k.shape[2]
    out = np.zeros_like(q)
    for r in range(rows):
        for t in range(length):
            if ids[r, t] == 0:
                continue
            keys = [s for s in range(t + 1) if ids[r, s] == ids[r, t]]
            for n in range(heads):
                logits = k[r, keys, n // group] @ q[r, t, n] / np.sqrt(dim)
                p = np.exp(logits - logits.max())
                out[r, t, n] = (p / p.sum()) @ v[r, keys, n // group]
    return out


def test_reference_matches_attention_written_out():
    rng = np.random.default_rng(0)
    ids = _packed_ids([(5, 9, 3), (17,)], 20)
    q, k, v = _qkv(rng, 2, 20, 4, 2, 8, jnp.float32)
    np.testing.assert_allclose(np.asarray(reference_segment_attention(q, k, v, jnp.asarray(ids))),
                               _dense_mask_dense_numpy(q, k, v, ids), atol=1e-5)


# Rows of 3 to 5 blocks of 32: segments crossing block edges, a segment longer than a block,
# an odd row length (ragged last block), a row that is all padding, a row with no padding.
CASES = {
    "packed": ([(40, 7, 70, 23), (100,), (), (5,) * 30], 150),
    "odd_length_full_row": ([(61, 36), (97,)], 97),
    "arbitrary_ids": (None, 128),
}


def _case_ids(name, rng):
    lengths, row_len = CASES[name]
    if lengths is not None:
        return _packed_ids(lengths, row_len)
    # Ids that are not contiguous runs: the skip rule must stay exact (a superset).
    return rng.integers(0, 4, size=(2, row_len)).astype(np.int32)


@pytest.mark.parametrize("name,heads,kv_heads", [
    ("packed", 4, 2), ("packed", 2, 2), ("odd_length_full_row", 4, 2), ("arbitrary_ids", 4, 2)])
def test_blocksparse_values_and_gradients_match_dense(name, heads, kv_heads):
    rng = np.random.default_rng(1)
    ids = _case_ids(name, rng)
    rows, length = ids.shape
    q, k, v = _qkv(rng, rows, length, heads, kv_heads, 16, jnp.float32)
    seg = jnp.asarray(ids)
    # A random linear functional of the outputs at real (non-padding) queries.
    weights = jnp.asarray(rng.normal(size=q.shape) * (ids > 0)[..., None, None], jnp.float32)

    def loss(fn):
        return lambda q, k, v: jnp.sum(fn(q, k, v, seg) * weights)

    def sparse(q, k, v, seg):
        return blocksparse_segment_attention(q, k, v, seg, block=32)

    out = sparse(q, k, v, seg)
    expected = reference_segment_attention(q, k, v, seg)
    np.testing.assert_allclose(np.asarray(out), np.asarray(expected), atol=2e-6)
    assert np.all(np.asarray(out)[ids == 0] == 0)  # padding attends to nothing
    grads = jax.grad(loss(sparse), argnums=(0, 1, 2))(q, k, v)
    expected_grads = jax.grad(loss(reference_segment_attention), argnums=(0, 1, 2))(q, k, v)
    for got, want in zip(grads, expected_grads, strict=True):
        np.testing.assert_allclose(np.asarray(got), np.asarray(want), atol=5e-6)


def test_blocksparse_bf16_matches_dense_to_bf16_rounding():
    rng = np.random.default_rng(2)
    ids = _packed_ids([(40, 7, 70, 23), (130,)], 150)
    q, k, v = _qkv(rng, 2, 150, 4, 2, 32, jnp.bfloat16)
    seg = jnp.asarray(ids)
    out = blocksparse_segment_attention(q, k, v, seg, block=32)
    assert out.dtype == jnp.bfloat16
    exact = reference_segment_attention(*(x.astype(jnp.float32) for x in (q, k, v)), seg)
    err = np.abs(np.asarray(out, np.float32) - np.asarray(exact))
    assert err.max() < 3e-2 and err.mean() < 3e-3
    grads = jax.grad(lambda q: jnp.sum(
        blocksparse_segment_attention(q, k, v, seg, block=32).astype(jnp.float32)))(q)
    assert grads.dtype == jnp.bfloat16 and np.isfinite(np.asarray(grads, np.float32)).all()


def _brute_force_block_pairs(ids, block):
    """Block pairs holding at least one attended (query, key), from the dense mask."""
    padded = -(-ids.shape[1] // block) * block
    return int(token_level_needed(np.pad(ids, ((0, 0), (0, padded - ids.shape[1]))),
                                  block, block).sum())


def test_block_pairs_of_packed_rows_are_exactly_the_attended_ones():
    rng = np.random.default_rng(3)
    ids = _packed_ids([(40, 7, 70, 23), (100,), (), (5,) * 30], 150)
    assert attended_block_pairs(ids, 32)[0] == _brute_force_block_pairs(ids, 32)
    arbitrary = rng.integers(0, 4, size=(2, 128)).astype(np.int32)
    assert attended_block_pairs(arbitrary, 32)[0] >= _brute_force_block_pairs(arbitrary, 32)


def test_a_row_of_many_short_segments_costs_a_band_not_the_triangle():
    """1,024 tokens of 50-token segments in 128-token blocks: a query block's segments start
    at most one block back, so at most 2 key blocks per query block (hand bound 2·8 − 1 =
    15 pairs), against 36 causal pairs, and the loop runs exactly that many iterations."""
    ids = _packed_ids([(50,) * 20], 1024)
    needed, causal = attended_block_pairs(ids, 128)
    assert causal == 8 * 9 // 2 == 36
    assert needed <= 2 * 8 - 1
    assert needed == _brute_force_block_pairs(ids, 128)
    _, _, count = _pair_list(jnp.asarray(ids), None, 128)
    assert int(jnp.max(count)) == needed  # the loop's trip count


def test_dispatch():
    assert resolve_attention_impl("auto", "cpu") == "blocksparse"
    assert resolve_attention_impl("auto", "gpu") == "pallas"
    assert resolve_attention_impl("auto", "tpu") == "splash"
    with pytest.raises(ValueError, match="unknown attention impl"):
        resolve_attention_impl("flash")
    rng = np.random.default_rng(4)
    q, k, v = _qkv(rng, 1, 300, 2, 1, 8, jnp.float32)
    # No segment ids: one causal sequence per row.
    np.testing.assert_allclose(
        np.asarray(segment_attention(q, k, v, None)),
        np.asarray(reference_segment_attention(q, k, v, jnp.ones((1, 300), jnp.int32))),
        atol=2e-6)


@pytest.mark.parametrize("impl", ["blocksparse", "pallas", "splash"])
def test_every_impl_through_the_dispatcher_matches_dense(impl):
    """What `attention_impl` selects (the kernels in interpret mode on CPU)."""
    rng = np.random.default_rng(5)
    ids = jnp.asarray(_packed_ids([(40, 33, 20), (90,)], 100))
    q, k, v = _qkv(rng, 2, 100, 4, 2, 16, jnp.float32)
    out = segment_attention(q, k, v, ids, impl=impl, block=32)
    np.testing.assert_allclose(np.asarray(out),
                               np.asarray(reference_segment_attention(q, k, v, ids)), atol=2e-5)


# ----------------------------------------------------------------------------- tree packing


def test_tree_reference_matches_attention_written_out():
    """Continuations read their own tokens and their group's one prefix, nothing else."""
    rng = np.random.default_rng(6)
    seg, pre = tree_batch()
    q, k, v = _qkv(rng, *seg.shape, 4, 2, 8, jnp.float32)
    out = reference_segment_attention(q, k, v, jnp.asarray(seg), jnp.asarray(pre))
    np.testing.assert_allclose(np.asarray(out), tree_attention_written_out(q, k, v, seg, pre),
                               atol=2e-5)


@pytest.mark.parametrize("block", [64, 128])
def test_tree_blocksparse_values_and_gradients_match_dense(block):
    rng = np.random.default_rng(7)
    seg, pre = (jnp.asarray(x) for x in tree_batch())
    q, k, v = _qkv(rng, *seg.shape, 4, 2, 16, jnp.float32)
    weights = jnp.asarray(rng.normal(size=q.shape) * (np.asarray(seg) > 0)[..., None, None],
                          jnp.float32)

    def loss(fn):
        return lambda q, k, v: jnp.sum(fn(q, k, v) * weights)

    def sparse(q, k, v):
        return blocksparse_segment_attention(q, k, v, seg, pre, block=block)

    def dense(q, k, v):
        return reference_segment_attention(q, k, v, seg, pre)

    np.testing.assert_allclose(np.asarray(sparse(q, k, v)), np.asarray(dense(q, k, v)),
                               atol=2e-6)
    grads = jax.grad(loss(sparse), argnums=(0, 1, 2))(q, k, v)
    expected = jax.grad(loss(dense), argnums=(0, 1, 2))(q, k, v)
    for got, want in zip(grads, expected, strict=True):
        # fp32 summation order: gradients of magnitude ~6 differ by ~1e-6 relative (seen
        # 5.7e-6 on an AMD EPYC at block 128); a wrong mask or block differs by O(1).
        np.testing.assert_allclose(np.asarray(got), np.asarray(want), atol=5e-6, rtol=2e-6)


@pytest.mark.parametrize("block", [64, 128])
def test_tree_block_pairs_are_exactly_the_attended_ones(block):
    """The skip rule keeps the pairs a continuation needs in its prefix and drops its
    siblings' blocks: on tree rows the needed pairs equal a brute-force count."""
    seg, pre = tree_batch()
    brute = tree_token_mask(seg, pre).reshape(
        seg.shape[0], 512 // block, block, 512 // block, block).any(axis=(2, 4))
    needed = np.asarray(needed_block_pairs(jnp.asarray(seg), block, prefix=jnp.asarray(pre)))
    np.testing.assert_array_equal(needed, brute)
    flat = np.asarray(needed_block_pairs(jnp.asarray(seg), block))
    assert np.all(flat <= needed)  # the prefix adds pairs, never removes one


def test_tree_through_the_dispatcher_and_without_prefixes_is_flat():
    rng = np.random.default_rng(8)
    seg, pre = (jnp.asarray(x) for x in tree_batch())
    q, k, v = _qkv(rng, *seg.shape, 2, 1, 8, jnp.float32)
    out = segment_attention(q, k, v, seg, prefix_ids=pre, impl="blocksparse", block=128)
    np.testing.assert_allclose(np.asarray(out), np.asarray(
        reference_segment_attention(q, k, v, seg, pre)), atol=2e-6)
    zeros = jnp.zeros_like(pre)  # no prefix anywhere: exactly the flat layout's attention
    np.testing.assert_array_equal(
        np.asarray(segment_attention(q, k, v, seg, prefix_ids=zeros, impl="blocksparse")),
        np.asarray(segment_attention(q, k, v, seg, impl="blocksparse")))
