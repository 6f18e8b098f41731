"""Flash attention with segment ids (block skipping) against the dense reference.

Pallas runs in interpret mode (CPU). Shapes are small and ragged on purpose: T = 100 pads to
128 with 32-token blocks, segments cross block edges, one is longer than a block, one row is
all padding, and one layout uses arbitrary non-contiguous ids (the skip rule must stay exact).
Values are compared at non-padding queries (padding queries must be exactly 0); gradients of a
random linear functional of the whole output are compared everywhere.
"""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from pallas_kernels._flash_attention_pallas import (
    block_bounds,
    pallas_segment_attention,
    triton_block,
)
from pallas_kernels.segment_attention import attention_block, reference_segment_attention
from tests.pallas_kernels.attention_cases import packed_row as _packed_row
from tests.pallas_kernels.attention_cases import token_level_needed as _token_level_needed
from tests.pallas_kernels.attention_cases import tree_batch, tree_edge_batch, tree_token_mask


def _segments(kind, batch, length, rng):
    if kind == "packed":
        # Row 0: odd lengths crossing the 32-token block edges (5 | 40 | 17 | 30, pad 8);
        # row 1: one 70-token segment (longer than two blocks), then padding.
        rows = [_packed_row([5, 40, 17, 30], length), _packed_row([70], length)]
    elif kind == "padding_row":
        rows = [_packed_row([33, 31, 1, 20], length), np.zeros(length, np.int32)]
    elif kind == "arbitrary":
        # Non-contiguous, non-monotone ids with padding scattered inside the row.
        rows = [rng.integers(0, 4, size=length).astype(np.int32) for _ in range(batch)]
    elif kind == "full":
        rows = [_packed_row([64, 50, 78], length), _packed_row([length], length)]
    elif kind == "short":
        rows = [_packed_row([100, 60, 1, 20], length), _packed_row([31, 1, 90], length)]
    else:
        raise ValueError(kind)
    return jnp.asarray(np.stack(rows[:batch]))


def _inputs(batch, length, n_heads, kv_heads, head_dim, dtype, seed):
    rng = np.random.default_rng(seed)

    def normal(*shape):
        return jnp.asarray(rng.normal(size=shape), jnp.float32)

    q = normal(batch, length, n_heads, head_dim).astype(dtype)
    k = normal(batch, length, kv_heads, head_dim).astype(dtype)
    v = normal(batch, length, kv_heads, head_dim).astype(dtype)
    w = normal(batch, length, n_heads, head_dim)
    return q, k, v, w, rng


def _value_and_grads(fn, q, k, v, seg, w):
    def loss(q, k, v):
        out = fn(q, k, v, seg)
        return jnp.sum(w * out.astype(jnp.float32)), out

    (_, out), grads = jax.jit(jax.value_and_grad(loss, argnums=(0, 1, 2), has_aux=True))(
        q, k, v)
    return out, grads


def _rel_err(got, want):
    got, want = np.asarray(got, np.float32), np.asarray(want, np.float32)
    return float(np.max(np.abs(got - want)) / max(1.0, float(np.max(np.abs(want)))))


CASES = {
    # name: (segments, T, N, K, H, block_q, block_k, dtype, tolerance)
    "packed_gqa_fp32": ("packed", 100, 4, 2, 16, 32, 32, jnp.float32, 1e-5),
    "padding_row_fp32": ("padding_row", 100, 4, 2, 16, 32, 32, jnp.float32, 1e-5),
    "arbitrary_ids_fp32": ("arbitrary", 100, 4, 2, 16, 32, 32, jnp.float32, 1e-5),
    "mha_full_rows_fp32": ("full", 192, 2, 2, 32, 32, 32, jnp.float32, 1e-5),
    "uneven_blocks_fp32": ("packed", 100, 4, 2, 16, 32, 16, jnp.float32, 1e-5),
    "packed_gqa_bf16": ("short", 192, 4, 2, 32, 32, 32, jnp.bfloat16, 2e-2),
}


# The per-query-head dK/dV grid on the GQA cases (N/K = 2) and the ragged-block one.
QUERY_HEAD_GRID_CASES = ("packed_gqa_fp32", "arbitrary_ids_fp32", "uneven_blocks_fp32",
                         "packed_gqa_bf16")


@pytest.mark.parametrize("case,dkdv_grid", [(c, "kv_heads") for c in CASES]
                         + [(c, "query_heads") for c in QUERY_HEAD_GRID_CASES])
def test_matches_dense_reference(case, dkdv_grid):
    kind, length, n_heads, kv_heads, head_dim, block_q, block_k, dtype, tol = CASES[case]
    q, k, v, w, rng = _inputs(2, length, n_heads, kv_heads, head_dim, dtype, seed=len(case))
    seg = _segments(kind, 2, length, rng)

    def kernel(q, k, v, seg):
        return pallas_segment_attention(q, k, v, seg, block_q=block_q, block_k=block_k,
                                        interpret=True, dkdv_grid=dkdv_grid)

    out, grads = _value_and_grads(kernel, q, k, v, seg, w)
    # The reference always runs in fp32 from the same (possibly bf16-rounded) inputs.
    f32 = [x.astype(jnp.float32) for x in (q, k, v)]
    out_ref, grads_ref = _value_and_grads(reference_segment_attention, *f32, seg, w)

    assert out.dtype == dtype and out.shape == q.shape
    assert all(g.dtype == dtype for g in grads)
    real = np.asarray(seg) != 0
    out_np = np.asarray(out, np.float32)
    assert np.all(out_np[~real] == 0.0), "padding queries must output exactly 0"
    assert _rel_err(out_np[real], np.asarray(out_ref)[real]) < tol
    for name, g, g_ref in zip("qkv", grads, grads_ref, strict=True):
        assert np.all(np.isfinite(np.asarray(g, np.float32))), name
        assert _rel_err(g, g_ref) < tol, name
    # Padding queries pass no gradient; padding keys/values receive none.
    assert np.all(np.asarray(grads[0], np.float32)[~real] == 0.0)
    assert np.all(np.asarray(grads[1], np.float32)[~real] == 0.0)
    assert np.all(np.asarray(grads[2], np.float32)[~real] == 0.0)


@pytest.mark.parametrize("block_q,block_k", [(32, 32), (32, 16), (16, 32)])
def test_bounds_cover_every_attended_pair(block_q, block_k):
    """The skip rule is conservative for arbitrary ids, exact ranges for packed rows."""
    rng = np.random.default_rng(1)
    length = 256
    arbitrary = rng.integers(0, 5, size=(3, length)).astype(np.int32)
    packed = np.stack([_packed_row(list(rng.integers(1, 50, size=8)), length)
                       for _ in range(3)])
    for seg, exact in ((arbitrary, False), (packed, True)):
        kv_bounds, q_bounds = (np.asarray(x) for x in block_bounds(jnp.asarray(seg), block_q,
                                                                   block_k))
        needed = _token_level_needed(seg, block_q, block_k)
        nq, nk = needed.shape[1:]
        i = np.arange(nq)[None, :, None]
        j = np.arange(nk)[None, None, :]
        # [B, nq, nk]: pair inside the query block's key range / the key block's query range.
        in_kv = (kv_bounds[:, :, None, 0] <= j) & (j < kv_bounds[:, :, None, 1])
        in_q = (q_bounds[:, None, :, 0] <= i) & (i < q_bounds[:, None, :, 1])
        assert np.all(in_kv[needed]) and np.all(in_q[needed])
        if exact:
            np.testing.assert_array_equal(in_kv, needed)
            np.testing.assert_array_equal(in_q, needed)


def test_many_short_segments_skip_most_pairs():
    """A row of 20-token segments with 32-token blocks: every segment spans ≤ 2 blocks, so a
    query block needs at most itself and the block before: ≤ 2·nq pairs, vs nq(nq+1)/2."""
    length, block = 1024, 32
    seg = np.stack([_packed_row([20] * 51, length), _packed_row([7, 13] * 40, length)])
    kv_bounds, _ = block_bounds(jnp.asarray(seg), block, block)
    computed = int(jnp.sum(kv_bounds[..., 1] - kv_bounds[..., 0]))  # pairs the kernels visit
    nq = length // block
    causal = 2 * nq * (nq + 1) // 2
    assert causal == 1056
    assert computed <= 2 * (2 * nq)
    assert computed * 8 < causal
    # Packed rows: the ranges are exactly the block pairs that hold an attended pair.
    assert computed == int(_token_level_needed(seg, block, block).sum())


def test_unknown_dkdv_grid_is_a_clear_error():
    q = jnp.zeros((1, 64, 2, 16))
    with pytest.raises(ValueError, match="dkdv_grid='per_block'"):
        pallas_segment_attention(q, q, q, jnp.ones((1, 64), jnp.int32), block_q=32,
                                 block_k=32, interpret=True, dkdv_grid="per_block")


def test_gpu_block_follows_dtype_and_head_dim():
    """Measured on an H200: fp32 (TF32 dots) at 128-token blocks and head_dim 64 asked for
    263,680 bytes of shared memory (232,448 available) and failed; 64 ran. bf16 ran at 128
    with head_dim 64 (Qwen2.5-0.5B) and 128 (Qwen2.5-1.5B and up)."""
    assert triton_block(jnp.float32, 64) == 64
    assert triton_block(jnp.bfloat16, 64) == triton_block(jnp.bfloat16, 128) == 128
    assert triton_block(jnp.float32, 128) == 32 and triton_block(jnp.bfloat16, 256) == 64
    assert attention_block("pallas", jnp.float32, 64) == 64
    assert attention_block("blocksparse", jnp.float32, 64) == 128  # CPU: not the GPU's rule


# ----------------------------------------------------------------------------- tree packing


def _tree_ids():
    """``tree_batch`` rows and ``tree_edge_batch`` rows padded to the same 512 tokens."""
    return tuple(jnp.asarray(np.concatenate([a, b]))
                 for a, b in zip(tree_batch(), tree_edge_batch(512), strict=True))


# Each block size and dK/dV grid once, and bf16 (interpret mode compiles slowly).
@pytest.mark.parametrize("block,dkdv_grid,dtype,tol", [
    (64, "kv_heads", jnp.float32, 1e-5),
    (128, "query_heads", jnp.float32, 1e-5),
    (128, "kv_heads", jnp.bfloat16, 2e-2),
])
def test_tree_rows_match_dense_reference(block, dkdv_grid, dtype, tol):
    """Prefix ids: each continuation reads its group's prefix and itself, never a sibling;
    values and q/k/v gradients against the dense reference with the same prefix ids."""
    seg, pre = _tree_ids()
    q, k, v, w, _ = _inputs(seg.shape[0], seg.shape[1], 4, 2, 16, dtype, seed=block)

    def kernel(q, k, v, seg):
        return pallas_segment_attention(q, k, v, seg, prefix_ids=pre, block_q=block,
                                        block_k=block, interpret=True, dkdv_grid=dkdv_grid)

    def reference(q, k, v, seg):
        return reference_segment_attention(q, k, v, seg, pre)

    out, grads = _value_and_grads(kernel, q, k, v, seg, w)
    f32 = [x.astype(jnp.float32) for x in (q, k, v)]
    out_ref, grads_ref = _value_and_grads(reference, *f32, seg, w)

    assert out.dtype == dtype and all(g.dtype == dtype for g in grads)
    real = np.asarray(seg) != 0
    out_np = np.asarray(out, np.float32)
    assert np.all(out_np[~real] == 0.0), "padding queries must output exactly 0"
    assert _rel_err(out_np[real], np.asarray(out_ref)[real]) < tol
    for name, g, g_ref in zip("qkv", grads, grads_ref, strict=True):
        assert _rel_err(g, g_ref) < tol, name
        assert np.all(np.asarray(g, np.float32)[~real] == 0.0), name


@pytest.mark.parametrize("dkdv_grid", ["query_heads"])
def test_tree_kernel_is_exact_for_arbitrary_prefix_ids(dkdv_grid):
    """Scattered, non-monotone ids and prefix ids (some equal to the query's own id, some
    naming later segments): the two ranges are then a superset of the needed blocks, and the
    in-pair mask keeps the result exact."""
    q, k, v, w, rng = _inputs(2, 100, 4, 2, 16, jnp.float32, seed=11)
    seg = jnp.asarray(rng.integers(0, 4, size=(2, 100)), jnp.int32)
    pre = jnp.asarray(rng.integers(0, 4, size=(2, 100)), jnp.int32)

    def kernel(q, k, v, seg):
        return pallas_segment_attention(q, k, v, seg, prefix_ids=pre, block_q=32, block_k=16,
                                        interpret=True, dkdv_grid=dkdv_grid)

    def reference(q, k, v, seg):
        return reference_segment_attention(q, k, v, seg, pre)

    out, grads = _value_and_grads(kernel, q, k, v, seg, w)
    out_ref, grads_ref = _value_and_grads(reference, q, k, v, seg, w)
    real = np.asarray(seg) != 0
    assert _rel_err(np.asarray(out)[real], np.asarray(out_ref)[real]) < 1e-5
    for name, g, g_ref in zip("qkv", grads, grads_ref, strict=True):
        assert _rel_err(g, g_ref) < 1e-5, name


def _visits(kv_bounds, nk):
    """[B, nq, nk] int: how often the forward/dq loops of each query block visit each key
    block, over the ranges in ``kv_bounds [B, nq, 2·r]``."""
    j = np.arange(nk)
    kv_bounds = np.asarray(kv_bounds)
    return sum(((kv_bounds[..., r, None] <= j) & (j < kv_bounds[..., r + 1, None])).astype(int)
               for r in range(0, kv_bounds.shape[-1], 2))


@pytest.mark.parametrize("block", [64, 128])
def test_tree_ranges_visit_exactly_the_attended_block_pairs(block):
    """On tree rows the two key-block ranges of each query block visit every block pair
    holding an attended (query, key) once and no other (earlier siblings' blocks are
    skipped), and each key block's query-block range is exactly the query blocks reading
    it. ``tree_edge_batch`` holds blocks whose own keys start before their prefix's."""
    for seg, pre in (tree_batch(), tree_edge_batch()):
        kv_bounds, q_bounds = block_bounds(jnp.asarray(seg), block, block, jnp.asarray(pre))
        b, length = seg.shape
        nb = length // block
        attended = tree_token_mask(seg, pre).reshape(b, nb, block, nb, block).any(axis=(2, 4))
        assert kv_bounds.shape == (b, nb, 4) and q_bounds.shape == (b, nb, 2)
        np.testing.assert_array_equal(_visits(kv_bounds, nb), attended.astype(int))
        i = np.arange(nb)[None, :, None]
        q_bounds = np.asarray(q_bounds)
        in_q = (q_bounds[:, None, :, 0] <= i) & (i < q_bounds[:, None, :, 1])
        np.testing.assert_array_equal(in_q, attended)


def test_tree_continuation_skips_its_siblings_blocks():
    """``sibling_between`` at 64-token blocks: prefix in block 0, the first continuation in
    blocks 0-2, the second in block 3. Block 3 visits the prefix's block and its own; a
    single range from the first needed block to the last would also visit 1 and 2."""
    seg, pre = tree_edge_batch()
    kv_bounds, _ = block_bounds(jnp.asarray(seg), 64, 64, jnp.asarray(pre))
    assert np.asarray(kv_bounds)[2, 3].tolist() == [0, 1, 3, 4]
    flat, _ = block_bounds(jnp.asarray(seg), 64, 64)
    assert np.asarray(flat)[2, 3].tolist() == [3, 4]  # without the prefix: its own only


def test_tree_kernel_without_prefixes_is_the_flat_kernel():
    """All-zero prefix ids: the prefix range is empty and the own range is the flat one, so
    the same blocks are visited in the same order: the same bits as the flat kernel."""
    q, k, v, _, rng = _inputs(2, 100, 4, 2, 16, jnp.float32, seed=9)
    seg = _segments("packed", 2, 100, rng)
    attend = functools.partial(pallas_segment_attention, block_q=32, block_k=32,
                               interpret=True)
    np.testing.assert_array_equal(
        np.asarray(attend(q, k, v, seg, prefix_ids=jnp.zeros_like(seg))),
        np.asarray(attend(q, k, v, seg)))
