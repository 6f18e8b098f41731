"""The cuDNN packed-attention path, checked where cuDNN does not run (CPU).

cuDNN itself is compiled only on a GPU (``scripts/bench/gpu_kernel_check.py``). Here:
``segment_runs`` against hand-written rows and a brute-force run finder; the whole wrapper
(conversion, fallback, zeros at padding) against the dense reference, with cuDNN replaced by
an independent model of its packed layout: the (offsets, lengths) turned back into segment
ids, then dense masked attention. A conversion that moves one boundary by one token changes
that model's ids and fails the comparison.
"""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from pallas_kernels._cudnn_attention import (
    cudnn_segment_attention,
    segment_runs,
    takes_packed_path,
)
from pallas_kernels.segment_attention import reference_segment_attention, resolve_attention_impl
from tests.pallas_kernels.attention_cases import packed_row


def _brute_runs(row):
    """[(start, length, id)] of the maximal runs of equal nonzero ids, by a Python scan."""
    runs, t = [], 0
    while t < len(row):
        if row[t] == 0:
            t += 1
            continue
        start = t
        while t < len(row) and row[t] == row[start]:
            t += 1
        runs.append((start, t - start, int(row[start])))
    return runs


def test_segment_runs_hand_example():
    # Two samples, a block-edge gap (align_when_free) between them, tail padding.
    row = np.array([1, 1, 1, 0, 0, 2, 2, 0], np.int32)
    offsets, lengths, ok = (np.asarray(x) for x in segment_runs(jnp.asarray(row[None]), 4))
    np.testing.assert_array_equal(offsets, [[0, 5, -1, -1, -1]])
    np.testing.assert_array_equal(lengths, [[3, 2, -1, -1]])
    assert ok.tolist() == [True]


@pytest.mark.parametrize("seed", range(3))
def test_segment_runs_match_a_brute_force_scan(seed):
    rng = np.random.default_rng(seed)
    length, max_segments = 97, 6
    rows = [packed_row(list(rng.integers(1, 30, size=rng.integers(0, 8))), 200)[:length]
            for _ in range(6)]
    rows += [rng.integers(0, 4, size=length).astype(np.int32) for _ in range(4)]  # arbitrary
    rows.append(np.array([2] * 10 + [1] * 10 + [0] * (length - 20), np.int32))  # decreasing
    rows.append(np.zeros(length, np.int32))
    seg = np.stack(rows)
    offsets, lengths, ok = (np.asarray(x) for x in segment_runs(jnp.asarray(seg), max_segments))
    for r, row in enumerate(seg):
        runs = _brute_runs(row)
        ids = [i for _, _, i in runs]
        increasing = all(a < b for a, b in zip(ids, ids[1:], strict=False))
        expressible = len(runs) <= max_segments and increasing
        assert bool(ok[r]) == expressible, (r, runs)
        kept = runs[:max_segments]
        np.testing.assert_array_equal(offsets[r, :len(kept)], [s for s, _, _ in kept])
        np.testing.assert_array_equal(lengths[r, :len(kept)], [n for _, n, _ in kept])
        assert np.all(offsets[r, len(kept):] == -1) and np.all(lengths[r, len(kept):] == -1)


def _ids_from_runs(offsets, lengths, length):
    """What cuDNN's packed layout describes, as segment ids: run r covers
    [offsets[r], offsets[r] + lengths[r]) and gets id r + 1; everything else is padding."""
    pos = jnp.arange(length)[None, None, :]
    inside = (pos >= offsets[:, :-1, None]) & (pos < (offsets[:, :-1] + lengths)[:, :, None])
    inside &= (lengths > 0)[:, :, None]
    run = jnp.arange(1, lengths.shape[1] + 1)[None, :, None]
    return jnp.max(jnp.where(inside, run, 0), axis=1)


def _model_of_cudnn(q, k, v, offsets, lengths):
    seg = _ids_from_runs(offsets, lengths, q.shape[1])
    out = reference_segment_attention(q, k, v, seg)
    # cuDNN's bytes outside every segment are unspecified: make them loud.
    return jnp.where((seg > 0)[:, :, None, None], out, jnp.nan)


def _fallback_marked(q, k, v, seg):
    """The fallback, recognisably: the reference times 2 (so a test can tell which ran)."""
    return 2.0 * reference_segment_attention(q, k, v, seg)


def _run(seg, max_segments=4, dtype=jnp.bfloat16, packed_attention=_model_of_cudnn):
    """((value, grads) of Σ w·out through the wrapper, the same through the fp32 dense
    reference). ``gpu_kernel_check.py`` passes cuDNN itself as ``packed_attention``."""
    rng = np.random.default_rng(0)
    b, length = seg.shape
    q = jnp.asarray(rng.normal(size=(b, length, 4, 16)), dtype)
    k = jnp.asarray(rng.normal(size=(b, length, 2, 16)), dtype)
    v = jnp.asarray(rng.normal(size=(b, length, 2, 16)), dtype)
    w = jnp.asarray(rng.normal(size=q.shape), jnp.float32)
    seg = jnp.asarray(seg)

    def loss(fn):
        return lambda q, k, v: jnp.sum(w * fn(q, k, v, seg).astype(jnp.float32))

    ours = jax.jit(jax.value_and_grad(loss(lambda *a: cudnn_segment_attention(
        *a, fallback=_fallback_marked, max_segments=max_segments,
        packed_attention=packed_attention)), argnums=(0, 1, 2)))(q, k, v)
    f32 = [x.astype(jnp.float32) for x in (q, k, v)]
    ref = jax.jit(jax.value_and_grad(loss(reference_segment_attention), argnums=(0, 1, 2)))(
        *f32)
    return ours, ref


def _close(a, b, tol):
    a, b = np.asarray(a, np.float32), np.asarray(b, np.float32)
    assert np.all(np.isfinite(a))
    return float(np.max(np.abs(a - b)) / max(1.0, float(np.max(np.abs(b))))) < tol


# Segments with gaps and tail padding, one row of a single sequence, one all padding.
PACKED_ROWS = np.stack([
    np.array([1] * 5 + [0] * 3 + [2] * 17 + [3] * 30 + [0] * 9, np.int32),
    np.ones(64, np.int32),
    np.zeros(64, np.int32),
])


def test_packed_rows_take_the_packed_path_exactly():
    (value, grads), (ref_value, ref_grads) = _run(PACKED_ROWS)
    assert _close(value, ref_value, 2e-2)  # not 2× the reference: the packed path ran
    for g, g_ref in zip(grads, ref_grads, strict=True):
        assert _close(g, g_ref, 2e-2)


@pytest.mark.parametrize("seg", [
    np.array([[1] * 8 + [2] * 8 + [3] * 8 + [4] * 8 + [5] * 8 + [0] * 24]), # 5 runs > 4
    np.array([[2] * 20 + [1] * 20 + [0] * 24]),                         # ids not increasing
    np.array([[1] * 10 + [2] * 10 + [1] * 10 + [0] * 34]),              # id 1 comes back
], ids=["too_many_runs", "decreasing_ids", "id_comes_back"])
def test_rows_cudnn_cannot_express_take_the_fallback(seg):
    (value, _), (ref_value, _) = _run(seg.astype(np.int32))
    assert _close(value, 2.0 * ref_value, 2e-2)


def test_which_calls_go_to_cudnn():
    def goes(rows, max_segments=4):
        offsets, lengths, ok = segment_runs(jnp.asarray(np.stack(rows), jnp.int32), max_segments)
        return bool(takes_packed_path(lengths, ok))

    assert goes([PACKED_ROWS[0], PACKED_ROWS[2]])  # a padding row beside a packed one
    assert not goes([np.zeros(64), np.zeros(64)])  # nothing to attend: zero sequences
    assert not goes([PACKED_ROWS[0], np.array([2] * 32 + [1] * 32)])  # one row inexpressible
    assert not goes([PACKED_ROWS[0]], max_segments=2)  # 3 runs > 2


def test_float32_and_cpu_are_clear_errors():
    q = jnp.zeros((1, 64, 2, 16), jnp.float32)
    seg = jnp.ones((1, 64), jnp.int32)
    with pytest.raises(ValueError, match="bfloat16 or float16"):
        cudnn_segment_attention(q, q, q, seg, fallback=_fallback_marked)
    with pytest.raises(ValueError, match="multiple of 8"):
        h = jnp.zeros((1, 64, 2, 12), jnp.bfloat16)
        cudnn_segment_attention(h, h, h, seg, fallback=_fallback_marked)
    with pytest.raises(ValueError, match="needs an NVIDIA GPU"):
        resolve_attention_impl("cudnn", "cpu")
    assert resolve_attention_impl("cudnn", "gpu") == "cudnn"
