"""`_same_bits`: the fixed-order row sum (its value against float64 and its independence of
the batch shape around a row) and the switches that apply it only in low precision."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from pallas_kernels._same_bits import (
    CPU_COMPILER_OPTIONS,
    compiler_options,
    fixed_order_sum,
    keeps_same_bits,
    rounds_low,
)
from pallas_kernels.segment_attention import runs_dense


@pytest.mark.parametrize("width", [1, 7, 56, 128, 896, 1536])
def test_fixed_order_sum_is_the_sum(width):
    x = np.random.default_rng(width).normal(size=(3, width)).astype(np.float32)
    np.testing.assert_allclose(np.asarray(jax.jit(fixed_order_sum)(x)),
                               x.astype(np.float64).sum(-1), rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("width", [128, 896])
def test_fixed_order_sum_of_a_row_does_not_depend_on_the_rows_around_it(width):
    """A decode's few rows and a packed row's 2,048 positions: the same row, the same bits
    (elementwise adds in a fixed order; no reduce for the compiler to split by shape)."""
    rows = np.random.default_rng(0).normal(size=(2 * 512, width)).astype(np.float32) ** 2
    whole = np.asarray(jax.jit(fixed_order_sum)(rows.reshape(2, 512, width))).reshape(-1)
    for few in (1, 3, 4):
        part = np.asarray(jax.jit(fixed_order_sum)(rows[5:5 + few]))
        np.testing.assert_array_equal(part, whole[5:5 + few])


def test_low_precision_switches():
    assert rounds_low(jnp.bfloat16) and rounds_low("float16") and not rounds_low("float32")
    assert keeps_same_bits("bfloat16") and not keeps_same_bits("float32")  # the suite is on CPU
    assert compiler_options("bfloat16") == CPU_COMPILER_OPTIONS
    assert compiler_options("float32") is None
    # Short rows run dense attention except where bf16 bits must match the sampler's blocks.
    assert runs_dense("blocksparse", 256) and runs_dense("blocksparse", 256, dtype="float32")
    assert not runs_dense("blocksparse", 256, dtype="bfloat16")
    assert runs_dense("reference", 4096, dtype="bfloat16")
    assert runs_dense("pallas", 256, dtype="bfloat16")
