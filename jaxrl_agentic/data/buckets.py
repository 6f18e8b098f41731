"""The shapes a packed batch may take, and where samples sit in a row.

Row counts and row lengths are rounded up to buckets (:func:`round_up_to_bucket`,
:func:`bucket_rows`) so that a run compiles a handful of programs rather than one per step;
a group of rows may be computed on a prefix of its row (:func:`prefix_lengths`) and a row
on fewer loss slots (:func:`loss_slots_bucket`). Which samples share a row is
:func:`first_fit_decreasing`'s; within a row, :func:`row_starts` places them (aligned, and
on attention-block edges where that is free and saves work).
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

# The attention's block (`pallas_kernels.segment_attention.BLOCK`): segment-aware attention
# computes a (query block, key block) pair when a segment spans both, and the learner cuts
# rows at multiples of it (`prefix_lengths`), so the blocks a sample's keys fall in, and
# with them its values, do not depend on the cut.
ATTENTION_BLOCK = 128
# The shortest prefix worth its own compiled branch. At 512 the default recipe's rows
# (512 tokens) keep their one program, and the values and curves measured with it.
_PREFIX_MIN = 512


def loss_slots_bucket(load: int, cap: int) -> int:
    """The fewest of ``cap, cap/2, cap/4, …`` loss slots (each rounded up to a multiple of
    64, at least 64) that hold ``load`` loss positions: a handful of shapes per row length."""
    slots = cap
    while slots > 64:
        half = max(64, -(-(slots // 2) // 64) * 64)
        if half < load or half >= slots:
            break
        slots = half
    return slots


def round_up_to_bucket(n: int, bucket: int = 0) -> int:
    """Smallest bucket value ``>= n``: the next power of two if ``bucket == 0``, otherwise
    the next multiple of ``bucket``. ``round_up_to_bucket(0) == 0``."""
    if n < 0 or bucket < 0:
        raise ValueError(f"round_up_to_bucket needs n >= 0 and bucket >= 0, got {n}, {bucket}")
    if n == 0:
        return 0
    if bucket == 0:
        return 1 << (n - 1).bit_length()
    return -(-n // bucket) * bucket


def bucket_rows(n: int, rows_bucket: int = 0) -> int:
    """Number of rows to allocate for ``n`` needed rows.

    ``rows_bucket == 0``: next power of two (at most 2× waste, ``log2`` distinct shapes);
    ``rows_bucket > 0``: next multiple of ``rows_bucket`` (waste < ``rows_bucket`` rows).
    """
    return round_up_to_bucket(n, rows_bucket)


def prefix_lengths(row_len: int, halvings: int) -> tuple[int, ...]:
    """The lengths a group of rows may be computed at, ascending, the last ``row_len``:
    ``row_len / 2^k`` (k ≤ ``halvings``) rounded down to a multiple of the attention block
    (128), those of at least 512 tokens. Each is one branch of the compiled step
    (``accumulation.on_shortest_prefix``)."""
    lengths = {row_len}
    for k in range(1, halvings + 1):
        n = (row_len >> k) // ATTENTION_BLOCK * ATTENTION_BLOCK
        if n >= _PREFIX_MIN:
            lengths.add(n)
    return tuple(sorted(lengths))


def block_pairs(starts: Sequence[int], lengths: Sequence[int], block: int) -> int:
    """(query block, key block) pairs segment-aware attention computes for samples at
    ``starts`` (ascending) of ``lengths`` in one row: a sample spanning n blocks needs the
    n(n+1)/2 causal pairs among them, and two consecutive samples that meet in one block
    share its diagonal pair (the only pair two disjoint runs of blocks can share)."""
    firsts = [s // block for s in starts]
    lasts = [(s + n - 1) // block for s, n in zip(starts, lengths, strict=True)]
    spans = [b - a + 1 for a, b in zip(firsts, lasts, strict=True)]
    shared = sum(last == first for last, first in zip(lasts, firsts[1:], strict=False))
    return sum(n * (n + 1) // 2 for n in spans) - shared


def row_starts(lengths: Sequence[int], align: int = 1, block: int = 0,
               limits: Sequence[int] = ()) -> list[int]:
    """Where a row's samples start: back to back, each at a multiple of ``align``; with
    ``block`` > 0 (a multiple of ``align``), sample k (and with it the samples after it)
    also moves up to the next multiple of ``block`` when that is free and saves attention:

    - free: the row's last token stays below the smallest of ``limits`` (ascending; the
      lengths the row may be computed at) that holds the row laid out tight, so no
      computed slot is added;
    - saves: :func:`block_pairs` of the whole row drops. A sample of n blocks' worth that
      starts mid-block may span n + 1 blocks, (n+1)(n+2)/2 − 1 pairs against n(n+1)/2 on
      the edge; the samples after it move too, so the row is counted whole.

    Greedy, first sample first; each accepted move lowers the row's pairs, so the result
    never costs more than the tight layout. Positions restart at 0 in every sample: where a
    sample starts changes none of its values (only, in floating point, the bits of its
    attention's block folding)."""
    starts, end = [], 0
    for n in lengths:
        starts.append(round_up_to_bucket(end, align))
        end = starts[-1] + n
    if not block or block % align or not lengths:
        return starts
    limit = min((x for x in limits if x >= end), default=end)
    pairs = block_pairs(starts, lengths, block)
    for k in range(1, len(lengths)):
        shift = round_up_to_bucket(starts[k], block) - starts[k]
        if shift == 0 or end + shift > limit:
            continue
        moved = starts[:k] + [x + shift for x in starts[k:]]
        moved_pairs = block_pairs(moved, lengths, block)
        if moved_pairs < pairs:
            starts, pairs, end = moved, moved_pairs, end + shift
    return starts


def footprints(lengths: Sequence[int], align: int, capacity: int) -> list[int]:
    """The slots each sample takes in a row when samples start at multiples of ``align``:
    its length rounded up to ``align``, at most ``capacity`` (such a sample fills its row
    alone). Placed back to back, footprints keep every start aligned and every sample
    inside the row whenever they sum to ≤ ``capacity``."""
    return [min(round_up_to_bucket(n, align), capacity) for n in lengths]


def first_fit_decreasing(
    lengths: Sequence[int], capacity: int, max_items_per_bin: int | None = None, *,
    loads: Sequence[int] | None = None, load_capacity: int | None = None,
) -> list[list[int]]:
    """Bins of item indices: items by decreasing length, each into the first bin with room.

    FFD uses at most ``11/9·OPT + 6/9`` bins. Ties keep input order, so the result is
    deterministic. Each bin's indices are returned in increasing order. With ``loads`` (one
    per item, e.g. its loss tokens) a bin must also keep ``Σ loads ≤ load_capacity``.
    """
    lengths = np.asarray(lengths, dtype=np.int64)
    if np.any(lengths > capacity):
        raise ValueError(f"an item of length {lengths.max()} exceeds bin capacity {capacity}")
    n = len(lengths)
    loads = np.zeros(n, np.int64) if loads is None else np.asarray(loads, np.int64)
    load_capacity = int(loads.max(initial=0)) if load_capacity is None else load_capacity
    if np.any(loads > load_capacity):
        raise ValueError(f"an item of load {loads.max()} exceeds the load capacity "
                         f"{load_capacity}")
    room = np.zeros(n, np.int64)  # at most one bin per item
    load_room = np.zeros(n, np.int64)
    count = np.zeros(n, np.int64)
    cap_items = n if max_items_per_bin is None else max_items_per_bin
    bins: list[list[int]] = []
    for i in np.argsort(-lengths, kind="stable"):
        open_ = len(bins)
        fits = ((room[:open_] >= lengths[i]) & (load_room[:open_] >= loads[i])
                & (count[:open_] < cap_items))
        b = int(np.argmax(fits)) if fits.any() else open_
        if b == open_:
            bins.append([])
            room[b], load_room[b] = capacity, load_capacity
        bins[b].append(int(i))
        room[b] -= lengths[i]
        load_room[b] -= loads[i]
        count[b] += 1
    return [sorted(members) for members in bins]
