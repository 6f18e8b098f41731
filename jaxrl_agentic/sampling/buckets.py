"""The shape buckets of the sampler's compiled programs: a few shapes, compiled once each.

Rows, prefill lengths, new-token budgets and cache lengths are rounded up to a small grid
(`next_power_of_two`; a compact prefill's `compact_rows` × `compact_length`), and attention
reads a cache's slots up to one of a few extents chosen at run time (`extent_index`), so a
run compiles a handful of programs, not one per prompt or stream length.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np


def next_power_of_two(n: int, minimum: int = 1) -> int:
    return max(minimum, 1 << max(0, int(n) - 1).bit_length())


def extent_index(extents: tuple[int, ...], end: int) -> jax.Array:
    """Index of the shortest extent holding slots below `end`."""
    return jnp.int32(min(int(np.searchsorted(extents, end)), len(extents) - 1))


def compact_length(n: int, minimum: int) -> int:
    """Tokens per row of a compact prefill of tails up to `n` long: a multiple of `minimum`
    up to 4·minimum, a power of two above. Continuous batching prefills one observation
    at a time (bench_rollout: 38–40 tokens), which a power of two pads to 64."""
    if n <= 4 * minimum:
        return minimum * max(1, -(-n // minimum))
    return next_power_of_two(n)


CHUNK_GRIDS = ("1.5x", "pow2")  # `SlotDecoder(chunk_grid=…)`: its rows and read lengths


def check_grid(grid: str) -> None:
    if grid not in CHUNK_GRIDS:
        raise ValueError(f"chunk grid must be one of {CHUNK_GRIDS}, got {grid!r}")


def chunk_width(n: int, capacity: int, grid: str = "1.5x") -> int:
    """Rows a decode chunk of `n` live rows computes, at most `capacity`: the smallest
    grid width ≥ n. "1.5x": 1, 2, 3, 4, 6, 8, 12, 16, 24, … (powers of two and 1.5×
    them: under a third of the rows computed are padding, two programs per doubling);
    "pow2": powers of two (up to half: 17 live rows compute 32). On a CPU a decode step
    costs in proportion to its rows."""
    check_grid(grid)
    width = next_power_of_two(n)
    if grid == "1.5x" and width >= 4 and 3 * width // 4 >= n:
        width = 3 * width // 4
    return min(capacity, width)


def compact_rows(n: int, capacity: int) -> int:
    """Rows of a compact prefill of `n` rows: the smallest capacity / 2^j ≥ n (a few
    compiled shapes per session size, compiled up front by `SlotDecoder.precompile`)."""
    rows = capacity
    while rows % 2 == 0 and rows // 2 >= n:
        rows //= 2
    return rows
