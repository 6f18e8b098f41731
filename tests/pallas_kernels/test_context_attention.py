"""The context-parallel attention's algorithm on one device: rows laid out in zigzag order
for 1, 2 and 4 shards (columns given, keys read in column order), against the dense
reference in packed order, forward and gradients, with segments, padding and a shared
prefix (tree packing). The split over devices is tests/runtime/test_context_parallel.py's."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from pallas_kernels.context_attention import context_segment_attention, zigzag_order
from pallas_kernels.segment_attention import reference_segment_attention

B, T, N, K, H = 2, 64, 4, 2, 8


def _case():
    rng = np.random.default_rng(0)
    q, k, v, w = (jnp.asarray(rng.normal(size=(B, T, n, H)), jnp.float32)
                  for n in (N, K, K, N))
    seg, pre = np.zeros((B, T), np.int32), np.zeros((B, T), np.int32)
    # Row 0: a prompt (1) shared by continuations 2 and 3, a sample of its own, padding.
    seg[0, :10], seg[0, 10:30], seg[0, 30:50], seg[0, 50:60] = 1, 2, 3, 4
    pre[0, 10:50] = 1
    seg[1, :] = 1  # one sequence over the whole row
    return q, k, v, w, jnp.asarray(seg), jnp.asarray(pre)


@pytest.mark.parametrize("shards", [1, 2, 4])
def test_zigzag_rows_give_the_reference_attention_and_gradients(shards):
    q, k, v, w, seg, pre = _case()
    order = zigzag_order(T, shards)
    back = np.argsort(order)
    columns = jnp.broadcast_to(jnp.asarray(order), (B, T))

    def laid_out(q, k, v):
        out = context_segment_attention(q[:, order], k[:, order], v[:, order], seg[:, order],
                                        columns, prefix_ids=pre[:, order],
                                        block=T // (2 * shards))
        return out[:, back]

    def reference(q, k, v):
        return reference_segment_attention(q, k, v, seg, pre)

    np.testing.assert_allclose(laid_out(q, k, v), reference(q, k, v), atol=2e-6)
    grads = [jax.grad(lambda *x, f=f: jnp.sum(f(*x) * w), argnums=(0, 1, 2))(q, k, v)
             for f in (laid_out, reference)]
    for got, want in zip(*grads, strict=True):
        np.testing.assert_allclose(got, want, atol=5e-6)
    assert float(jnp.abs(laid_out(q, k, v)[0, 60:]).max()) == 0.0  # padding attends to nothing
