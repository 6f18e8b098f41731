"""The sampler's shape buckets against brute force over their grids."""

import pytest
from flax import nnx

from jaxrl_agentic.models import Transformer
from jaxrl_agentic.sampling import Sampler
from jaxrl_agentic.sampling.buckets import chunk_width
from tests.sampling.test_jax_sampler import CFG


def grid_brute_force(grid: str, top: int = 4096) -> list[int]:
    powers = [1 << k for k in range(top.bit_length() + 1)]
    if grid == "pow2":
        return powers
    return sorted(set(powers) | {3 * p // 2 for p in powers if p >= 2})


@pytest.mark.parametrize("grid", ["1.5x", "pow2"])
def test_chunk_width_is_the_smallest_grid_width_holding_the_live_rows(grid):
    widths = grid_brute_force(grid)
    for capacity in (1, 5, 8, 24, 32, 100):
        for n in range(1, capacity + 1):
            expected = min(capacity, min(w for w in widths if w >= n))
            assert chunk_width(n, capacity, grid) == expected, (n, capacity)


def test_under_a_third_of_a_1_5x_width_is_padding_and_its_widths_are_few():
    assert [chunk_width(n, 64) for n in (3, 5, 7, 9, 13, 17, 25, 33)] == [
        3, 6, 8, 12, 16, 24, 32, 48]
    assert all(3 * (chunk_width(n, 10**6) - n) < chunk_width(n, 10**6) for n in range(1, 5000))
    assert 3 * (chunk_width(17, 64, "pow2") - 17) > 32  # powers of two: up to half
    # Two widths per doubling: 1, 2, 3, 4, 6, 8, 12, 16, 24, 32 up to 32.
    assert len({chunk_width(n, 32) for n in range(1, 33)}) == 10
    assert len({chunk_width(n, 32, "pow2") for n in range(1, 33)}) == 6


def test_an_unknown_grid_is_refused():
    with pytest.raises(ValueError, match="chunk grid must be one of"):
        chunk_width(3, 8, "fine")
    with pytest.raises(ValueError, match="chunk grid must be one of"):
        Sampler(Transformer(CFG, rngs=nnx.Rngs(0)), max_total_len=64).key_extents(64, "2x")
