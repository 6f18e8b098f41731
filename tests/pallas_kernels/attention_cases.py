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


def tree_row(groups, length):
    """(segment ids, prefix ids) of one tree-packed row: ``groups`` lists, in row order,
    ``(prefix_len, [member lengths])`` (a prefix segment followed by the continuations that
    read it) or a bare ``int`` (a flat segment). Ids count up along the row; a
    continuation's prefix id is its group's prefix segment id, 0 elsewhere."""
    seg, pre = np.zeros(length, np.int32), np.zeros(length, np.int32)
    start, sid = 0, 0
    for group in groups:
        prefix_len, members = (group, []) if isinstance(group, int) else group
        sid += 1
        seg[start:start + prefix_len] = sid
        start, parent = start + prefix_len, sid
        for n in members:
            sid += 1
            seg[start:start + n] = sid
            pre[start:start + n] = parent
            start += n
    assert start <= length
    return seg, pre


# Rows of 512 tokens (4 blocks of 128, 8 of 64) that cross blocks every way: a prefix longer
# than a block, members shorter and longer than one, one-token continuations, a prefix with
# no member left in this row (its group split across rows), and flat segments beside trees.
TREE_ROWS = {
    "long_prefix": [(200, [60, 130, 1]), 40],
    "short_prefix_many_members": [(10, [30, 5, 70, 1, 90]), (50, [100, 20])],
    "split_group_tail": [(150, []), 30, (90, [180])],
    "flat_only": [120, 7, 300],
}


def tree_batch(length=512):
    """[B, length] segment and prefix ids: one row per ``TREE_ROWS`` entry."""
    rows = [tree_row(groups, length) for groups in TREE_ROWS.values()]
    return np.stack([r[0] for r in rows]), np.stack([r[1] for r in rows])


def tree_token_mask(seg, pre):
    """[B, T, T] numpy: query t attends key s (causal; same id, or the key's id is t's
    prefix id), written out token by token."""
    seg, pre = np.asarray(seg), np.asarray(pre)
    pos = np.arange(seg.shape[1])
    same = (seg[:, :, None] == seg[:, None, :]) | (
        (pre[:, :, None] == seg[:, None, :]) & (pre[:, :, None] != 0))
    return (pos[None, :] <= pos[:, None])[None] & same & (seg[:, :, None] != 0)


def tree_attention_written_out(q, k, v, seg, pre):
    """Attention over ``tree_token_mask`` in float64 numpy: q [B, T, N, H], k/v
    [B, T, K, H] → [B, T, N, H], zeros where a query attends to nothing."""
    q, k, v = (np.asarray(x, np.float64) for x in (q, k, v))
    group = q.shape[2] // k.shape[2]
    k, v = np.repeat(k, group, axis=2), np.repeat(v, group, axis=2)
    scores = np.einsum("btnh,bsnh->bnts", q, k) / np.sqrt(q.shape[-1])
    mask = tree_token_mask(seg, pre)[:, None]
    scores = np.where(mask, scores, -np.inf)
    top = np.max(np.where(mask, scores, -1e30), axis=-1, keepdims=True)
    weights = np.where(mask, np.exp(scores - top), 0.0)
    total = weights.sum(-1, keepdims=True)
    probs = weights / np.where(total > 0, total, 1.0)
    return np.einsum("bnts,bsnh->btnh", probs, v)


# Rows of 256 tokens for the block edges of kernels that walk a query block's prefix keys and
# own keys as two runs of key blocks. The first two put in one query block the end of a flat
# segment begun in an earlier block, then a group's prefix and continuations: the block's
# own-segment keys start before its prefix's, so walking the prefix's blocks first and the
# own ones from the prefix's end would miss them (blocks of 64: row 1, of 128: row 2). In the
# third, the second continuation's blocks (64) lie after the whole first one's: it skips them.
TREE_EDGE_ROWS = {
    "flat_into_group": [100, (10, [30, 40]), 50],
    "long_flat_into_group": [200, (10, [40]), 6],
    "sibling_between": [(50, [142, 40])],
}


def tree_edge_batch(length=256):
    """[B, length] segment and prefix ids: one row per ``TREE_EDGE_ROWS`` entry."""
    rows = [tree_row(groups, length) for groups in TREE_EDGE_ROWS.values()]
    return np.stack([r[0] for r in rows]), np.stack([r[1] for r in rows])
