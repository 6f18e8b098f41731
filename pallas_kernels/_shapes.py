"""Small integer helpers for block and tile shapes, shared by the kernels' wrappers."""

from __future__ import annotations


def round_up(x: int, m: int) -> int:
    """The least multiple of ``m`` that is ≥ ``x``."""
    return -(-x // m) * m


def is_pow2(x: int) -> bool:
    return x > 0 and x & (x - 1) == 0
