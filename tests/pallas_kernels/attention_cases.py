"""Packed rows and a brute-force count of the block pairs they attend in, shared by the
segment-attention tests."""

import numpy as np


def packed_row(lengths, length):
    """ids 1, 2, ... for consecutive runs of `lengths`, 0 (padding) after them."""
    row = np.zeros(length, np.int32)
    start = 0
    for sid, n in enumerate(lengths, start=1):
        row[start:start + n] = sid
        start += n
    assert start <= length
    return row


def token_level_needed(seg, block_q, block_k):
    """[B, nq, nk] numpy: block pairs holding at least one attended (query, key) pair, from
    the dense token-level mask (T a multiple of both blocks)."""
    seg = np.asarray(seg)
    length = seg.shape[1]
    pos = np.arange(length)
    attend = ((pos[None, :] <= pos[:, None])[None] & (seg[:, :, None] == seg[:, None, :])
              & (seg[:, :, None] != 0))
    b = seg.shape[0]
    return attend.reshape(b, length // block_q, block_q, length // block_k, block_k).any(
        axis=(2, 4))
