"""bench_attention's padded layout (what cuDNN is timed on) and its FLOP count."""

import os
import sys

import jax
import jax.numpy as jnp
import numpy as np

from pallas_kernels.segment_attention import reference_segment_attention
from tests.conftest import _ROOT, load_script


def _bench():
    sys.path.insert(0, os.path.join(_ROOT, "scripts", "bench"))  # its `import common`
    return load_script("scripts/bench/bench_attention.py")


def test_padded_batch_is_the_packed_attention_one_sample_per_row():
    """Causal attention with sequence lengths on the padded batch (the cuDNN path's layout,
    run here through XLA) equals segment attention on the packed rows, token for token."""
    bench = _bench()
    rng = np.random.default_rng(0)
    ids, lengths = bench.packed_segment_ids(2, 256, 20, 90, rng)
    assert int(ids.max()) > 1  # several samples per row
    q, k, v = (rng.normal(size=(2, 256, h, 16)).astype(np.float32) for h in (4, 2, 2))
    packed = np.asarray(reference_segment_attention(q, k, v, jnp.asarray(ids)))
    width = 128
    lens = jnp.asarray(lengths, jnp.int32)
    padded = jax.nn.dot_product_attention(
        *(jnp.asarray(bench.padded_batch(x, ids, lengths, width)) for x in (q, k, v)),
        is_causal=True, query_seq_lengths=lens, key_value_seq_lengths=lens)
    real = np.arange(width)[None, :] < np.asarray(lengths)[:, None]
    want = bench.padded_batch(packed, ids, lengths, width)
    np.testing.assert_allclose(np.asarray(padded)[real], want[real], atol=1e-5)
    assert np.all(bench.padded_batch(packed, ids, lengths, width)[~real] == 0)


def test_useful_flops_by_hand():
    """4·N·H·Σ L(L+1)/2 forward, 3.5x that forward + backward: lengths 3 and 5 hold 6 + 15
    attended pairs; 2 heads of 4 dims give 4·2·4·21 = 672."""
    bench = _bench()
    assert bench.useful_flops([3, 5], 2, 4, forward_only=True) == 672
    assert bench.useful_flops([3, 5], 2, 4, forward_only=False) == 2352
