"""Packing samples into the learner's fixed-shape batches.

One contract (:class:`PackedBatch`, arrays of shape ``[rows, row_len]``), one layout:
:func:`pack_samples` is padding-free. Samples are placed first-fit-decreasing into rows of
``micro_batch_max_tokens`` tokens; each row is one micro-batch. Several samples share a row,
told apart by ``segment_ids`` (attention must not cross segments) and with ``positions``
restarting at 0 for each. :class:`PackingConfig` holds the packing settings of a run (one
object, validated once, shared by the learner, the critic and the debug dump). The padded
layouts the packing benchmark compares against live in ``data/baseline_packing.py``.

Row counts and row lengths are rounded up to buckets (``data/buckets.py``) so that a run
compiles a handful of programs rather than one per step. Every sample is first cut to
``sequence_length`` tokens from the right (see
:func:`~jaxrl_agentic.data.types.truncate_sample`); the number of truncated samples is kept
on the batch.

A segment never straddles two rows, which is what makes the per-segment loss reductions
(``algos/reductions.py``) exact when micro-batches are accumulated.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Sequence

import numpy as np

from jaxrl_agentic.data.buckets import (
    ATTENTION_BLOCK,
    bucket_rows,
    first_fit_decreasing,
    footprints,
    loss_slots_bucket,
    prefix_lengths,
    round_up_to_bucket,
    row_starts,
)
from jaxrl_agentic.data.tree_packing import assemble_tree_rows, tree_rows
from jaxrl_agentic.data.types import Sample, truncate_sample

# Per-token fields copied from each Sample into the batch; the optional ones stay None in
# the batch unless every sample has them.
_REQUIRED_TOKEN_FIELDS = ("loss_mask", "advantages", "old_logprobs")
_OPTIONAL_TOKEN_FIELDS = ("ref_logprobs", "returns", "values")


@dataclasses.dataclass(frozen=True)
class PackingConfig:
    """How a run packs samples into micro-batch rows (the run config's fields of these names).

    ``micro_batch_max_tokens``: tokens per row (one row = one micro-batch);
    ``sequence_length``: a sample's tokens are cut to this many first; ``rows_bucket``: row
    counts are rounded up to a multiple of it (0 = the next power of two); ``fixed_rows``:
    every mini-batch is packed to the most rows it can need (one per sample), so the train
    step's shape never follows episode lengths and the padding rows are skipped in the scan;
    ``pad_token_id``: the token id of padding slots; ``loss_slots``: the most loss tokens a
    row may hold (0 = ``micro_batch_max_tokens``, no limit). The learner runs its LM head,
    logprobs and loss only at a row's loss positions, gathered into ``loss_slots`` slots
    (:meth:`PackedBatch.loss_index`), so a row of 8,192 tokens of which 400 carry loss costs
    400-odd LM-head rows, not 8,192; the packer fills rows under both capacities.
    ``sample_align``: every sample starts at a multiple of it within its row (1 = packed
    tight). At the attention block (128) each sample's key blocks are the blocks a sampler
    reads its own cache in, so in bf16 the learner's attention matches the sampler's to the
    last bit (``pallas_kernels._online_softmax``); it costs up to ``sample_align − 1``
    padding slots per sample. ``row_len_buckets`` k and ``row_len_ratio`` r: a batch's row
    length is chosen among ``micro_batch_max_tokens / r^i`` (i < k, rounded up to a multiple
    of 16, each at least its longest sample) as the one that computes the fewest slots (busy
    rows × row length), so 8 short samples do not fill one 8,192-token row's worth of work;
    at most k shapes per row count, each compiled once (1 = fixed). With r = 2 a batch that
    fits one row may still compute up to 2× its tokens; r = 2^(1/4) bounds that at 1.19×
    (more shapes). With k > 1 and a ``loss_slots`` cap, each batch's loss slots are likewise
    the fewest of ``loss_slots / 2^j`` that hold its fullest row
    (:func:`loss_slots_bucket`). ``row_prefixes`` h: the learner computes each group of
    rows (one per batch shard) on the shortest of ``T, T/2, …, T/2^h`` (multiples of 128, at
    least 512) that holds its real tokens (``accumulation.on_shortest_prefix``: exact, one
    compiled branch each), so the part-filled last group of a mini-batch costs a shorter
    row (0 = always the whole row). ``align_when_free``: a sample that would straddle one
    more 128-token attention block than its length needs starts on the next block edge
    instead, when the row's slack allows it without adding a computed slot
    (:func:`row_starts`): the same rows and slots, fewer attention block pairs (388 → 354
    on ``bench_packing.py``'s 2,048-token rows). ``share_group_prefix``: tree packing
    (:func:`pack_tree`; ``sample_align`` and ``align_when_free`` do not apply), which implies
    ``group_minibatches`` (mini-batches of whole groups, ``minibatch.split_minibatches``).

    A rule that fails raises ``ValueError("<field>: <why>")``; ``config.validate`` reports it
    as ``config.<field>: <why>``.
    """

    micro_batch_max_tokens: int = 4096
    sequence_length: int = 2048
    rows_bucket: int = 4
    fixed_rows: bool = True
    pad_token_id: int = 0
    loss_slots: int = 0
    row_len_buckets: int = 1
    row_len_ratio: float = 2.0
    sample_align: int = 1
    row_prefixes: int = 2
    align_when_free: bool = True
    share_group_prefix: bool = False
    group_minibatches: bool = False

    @property
    def keeps_groups(self) -> bool:
        """Whether mini-batches take whole prompt groups (``minibatch.split_minibatches``)."""
        return self.share_group_prefix or self.group_minibatches

    def __post_init__(self):
        if self.sequence_length < 1:
            raise ValueError(f"sequence_length: must be > 0, got {self.sequence_length}")
        if self.micro_batch_max_tokens < self.sequence_length:
            raise ValueError(
                f"micro_batch_max_tokens: {self.micro_batch_max_tokens} < sequence_length="
                f"{self.sequence_length}: a full-length sample would not fit in a micro-batch"
            )
        if self.rows_bucket < 0:
            raise ValueError(f"rows_bucket: must be >= 0, got {self.rows_bucket}")
        if self.row_len_buckets < 1:
            raise ValueError(f"row_len_buckets: must be >= 1, got {self.row_len_buckets}")
        if not self.row_len_ratio > 1:
            raise ValueError(f"row_len_ratio: must be > 1, got {self.row_len_ratio}")
        if self.row_prefixes < 0:
            raise ValueError(f"row_prefixes: must be >= 0, got {self.row_prefixes}")
        if self.sample_align < 1:
            raise ValueError(f"sample_align: must be >= 1, got {self.sample_align}")
        if not 0 <= self.loss_slots <= self.micro_batch_max_tokens:
            raise ValueError(f"loss_slots: must lie in [0, micro_batch_max_tokens="
                             f"{self.micro_batch_max_tokens}] (0 = no limit), got "
                             f"{self.loss_slots}")

    def batch_keys(self, keys: Sequence[str]) -> tuple[str, ...]:
        """``keys`` of a program's batch, with ``prefix_ids`` when rows are tree-packed."""
        return tuple(keys) + (("prefix_ids",) if self.share_group_prefix else ())

    @property
    def loss_slots_per_row(self) -> int:
        return self.loss_slots or self.micro_batch_max_tokens

    def row_lengths(self) -> list[int]:
        """The row lengths a batch may get, longest first."""
        top = self.micro_batch_max_tokens
        lengths = set()
        for i in range(self.row_len_buckets):
            # − 1e-9: a power of an irrational ratio a hair off an integer (2^(1/4))^4 must
            # not round 4,096 up to 4,097 (then 4,112).
            n = math.ceil(top / self.row_len_ratio**i - 1e-9)
            lengths.add(min(top, -(-n // 16) * 16) if n > 16 else max(n, 1))
        return sorted(lengths, reverse=True)

    def row_len_for(self, samples: Sequence[Sample]) -> int:
        """The row length of :meth:`row_lengths` that computes the fewest slots for
        ``samples`` (the longest on ties: fewer rows)."""
        lengths = [min(len(s), self.sequence_length) for s in samples]
        if self.row_len_buckets == 1 or not lengths:
            return self.micro_batch_max_tokens
        loads = loss_loads(samples, lengths, self.loss_slots)
        costs = {}  # row length → slots computed (busy rows × row length)
        for row in self.row_lengths():
            if row < max(lengths):
                break
            if self.share_group_prefix:
                rows = tree_rows(samples, lengths, loads, row, self.loss_slots_for(row))[1]
            else:
                rows = first_fit_decreasing(footprints(lengths, self.sample_align, row), row,
                                            loads=loads, load_capacity=self.loss_slots_for(row))
            costs[row] = len(rows) * row
        return min(costs, key=lambda row: (costs[row], -row))

    def loss_slots_for(self, row_len: int) -> int:
        """Loss slots of a row of ``row_len`` tokens (never more than its tokens)."""
        return min(self.loss_slots or row_len, row_len)

    def pack(self, samples: Sequence[Sample], *, num_rows: int | None = None,
             rows_bucket: int | None = None) -> PackedBatch:
        """:func:`pack_samples` with these settings, at :meth:`row_len_for` ``samples``."""
        row = self.row_len_for(samples)
        if self.share_group_prefix:
            return self._fit_loss_slots(pack_tree(
                samples, micro_batch_max_tokens=row,
                sequence_length=min(self.sequence_length, row),
                rows_bucket=self.rows_bucket if rows_bucket is None else rows_bucket,
                num_rows=num_rows, pad_token_id=self.pad_token_id,
                loss_slots=self.loss_slots_for(row) if self.loss_slots else 0))
        batch = pack_samples(
            samples,
            micro_batch_max_tokens=row,
            # A row shorter than sequence_length is only chosen when every sample fits it:
            # cutting at the row then cuts nothing more.
            sequence_length=min(self.sequence_length, row),
            rows_bucket=self.rows_bucket if rows_bucket is None else rows_bucket,
            num_rows=num_rows,
            pad_token_id=self.pad_token_id,
            loss_slots=self.loss_slots_for(row) if self.loss_slots else 0,
            sample_align=self.sample_align,
            block_align=ATTENTION_BLOCK if self.align_when_free else 0,
            row_prefixes=self.row_prefixes,
        )
        return self._fit_loss_slots(batch)

    def _fit_loss_slots(self, batch: PackedBatch) -> PackedBatch:
        if self.loss_slots and self.row_len_buckets > 1:
            # Rows sized to the batch, and their loss slots too: the LM head runs at every
            # slot, so 768 loss tokens in a row capped at 2,048 slots would pay for 2,048.
            load = loss_positions(batch.loss_mask, batch.segment_ids).sum(axis=1).max(
                initial=0)
            batch = dataclasses.replace(batch, loss_slots=loss_slots_bucket(
                int(load), batch.loss_slots))
        return batch


def loss_loads(samples: Sequence[Sample], lengths: Sequence[int], loss_slots: int) -> list[int]:
    """Loss tokens of each sample within its first ``lengths[i]`` tokens (what a row holds
    of it after the cut); one over ``loss_slots`` (0 = no cap) is a ``ValueError`` naming
    the setting."""
    loads = [int(np.count_nonzero(s.loss_mask[:n])) for s, n in zip(samples, lengths,
                                                                     strict=True)]
    if loss_slots and max(loads, default=0) > loss_slots:
        raise ValueError(f"a sample has {max(loads)} loss tokens > micro_batch_max_loss_tokens="
                         f"{loss_slots} (the most a row may hold); raise it (0 = automatic)")
    return loads


def loss_positions(loss_mask: np.ndarray, segment_ids: np.ndarray) -> np.ndarray:
    """``[n, T]`` bool, prediction index: hidden state ``i`` predicts token ``i + 1``, which
    carries loss, in the same (non-padding) segment. The learner's mask is the same
    (``learner.next_token_valid`` times the shifted loss mask)."""
    pred = np.zeros(loss_mask.shape, bool)
    pred[:, :-1] = ((loss_mask[:, 1:] > 0) & (segment_ids[:, :-1] > 0)
                    & (segment_ids[:, :-1] == segment_ids[:, 1:]))
    return pred


@dataclasses.dataclass
class PackedBatch:
    """Fixed-shape batch: ``[n_micro, row_len]`` token arrays plus per-segment metadata.

    Token arrays (``[n_micro, row_len]``): ``tokens`` (int32), ``positions`` (int32, 0 at
    each segment start), ``segment_ids`` (int32, 0 = padding, 1.. = samples within the row),
    ``loss_mask``, ``advantages``, ``old_logprobs`` (float32) and the optional
    ``ref_logprobs``, ``returns``, ``values`` (float32 or None). Padding slots are 0
    everywhere.

    Segment arrays (``[n_micro, max_segments]`` int32, indexed by ``segment_id - 1``, -1 where
    unused): ``seg_traj_id``, ``seg_turn``, ``seg_prompt_len``, ``seg_response_len`` (after
    truncation) and ``sample_index`` (position of the sample in the input list).

    ``num_truncated``: how many input samples were cut to ``sequence_length``;
    ``loss_slots``: the width of :meth:`loss_index` (0 = ``row_len``).

    Tree packing (:func:`pack_tree`) adds ``prefix_ids`` (``[n_micro, row_len]``: the prefix
    segment a continuation token also reads, else 0), ``seg_offset`` (a segment's start in
    its sample) and ``shared_saved`` (tokens not computed); flat batches: None / 0.
    """

    tokens: np.ndarray
    positions: np.ndarray
    segment_ids: np.ndarray
    loss_mask: np.ndarray
    advantages: np.ndarray
    old_logprobs: np.ndarray
    ref_logprobs: np.ndarray | None
    returns: np.ndarray | None
    values: np.ndarray | None
    seg_traj_id: np.ndarray
    seg_turn: np.ndarray
    seg_prompt_len: np.ndarray
    seg_response_len: np.ndarray
    sample_index: np.ndarray
    num_truncated: int = 0
    loss_slots: int = 0
    prefix_ids: np.ndarray | None = None
    seg_offset: np.ndarray | None = None
    shared_saved: int = 0

    @property
    def num_micro_batches(self) -> int:
        return int(self.tokens.shape[0])

    @property
    def row_len(self) -> int:
        return int(self.tokens.shape[1])

    def token_arrays(self) -> dict[str, np.ndarray]:
        """The ``[n_micro, row_len]`` arrays the train step consumes (None fields left out)."""
        names = ("tokens", "positions", "segment_ids", *_REQUIRED_TOKEN_FIELDS)
        names += tuple(n for n in (*_OPTIONAL_TOKEN_FIELDS, "prefix_ids")
                       if getattr(self, n) is not None)
        return {name: getattr(self, name) for name in names}

    def device_arrays(self) -> dict[str, np.ndarray]:
        """:meth:`token_arrays` and ``loss_index`` ``[n_micro, loss_slots]``: all a step reads."""
        return {**self.token_arrays(), "loss_index": self.loss_index()}

    def loss_index(self) -> np.ndarray:
        """``[n_micro, loss_slots]`` int32: per row, the prediction indices of
        :func:`loss_positions` in increasing order, then −1. A row with more loss positions
        than slots is a ``ValueError`` (the packer never makes one)."""
        pred = loss_positions(self.loss_mask, self.segment_ids)
        slots = self.loss_slots or self.row_len
        counts = pred.sum(axis=1)
        if counts.size and counts.max() > slots:
            raise ValueError(f"a row has {counts.max()} loss positions > loss_slots={slots}")
        index = np.full((self.num_micro_batches, slots), -1, np.int32)
        rows, cols = np.nonzero(pred)
        index[rows, np.arange(rows.size) - np.repeat(np.cumsum(counts) - counts, counts)] = cols
        return index


def truncate_samples(samples: Sequence[Sample], sequence_length: int | None):
    if sequence_length is None:
        return list(samples), 0
    pairs = [truncate_sample(s, sequence_length) for s in samples]
    return [s for s, _ in pairs], sum(cut for _, cut in pairs)


def common_optional_fields(samples: Sequence[Sample]) -> tuple[str, ...]:
    """Optional fields present in all samples; a field present in only some is an error."""
    present = []
    for name in _OPTIONAL_TOKEN_FIELDS:
        have = sum(getattr(s, name) is not None for s in samples)
        if 0 < have < len(samples):
            raise ValueError(f"Sample.{name} is set on {have} of {len(samples)} samples")
        if samples and have == len(samples):
            present.append(name)
    return tuple(present)


def assemble_batch(
    samples: Sequence[Sample],
    rows: Sequence[Sequence[int]],
    *,
    num_rows: int,
    row_len: int,
    max_segments: int,
    num_truncated: int,
    pad_token_id: int,
    optional_fields: tuple[str, ...],
    loss_slots: int = 0,
    sample_align: int = 1,
    block_align: int = 0,
    limits: Sequence[int] = (),
) -> PackedBatch:
    """Writes ``samples`` into a batch; ``rows[r]`` lists the sample indices of row ``r``,
    placed at :func:`row_starts` ``(lengths, sample_align, block_align, limits)``."""
    shape, seg_shape = (num_rows, row_len), (num_rows, max_segments)
    tokens = np.full(shape, pad_token_id, np.int32)
    positions = np.zeros(shape, np.int32)
    segment_ids = np.zeros(shape, np.int32)
    floats = {n: np.zeros(shape, np.float32) for n in _REQUIRED_TOKEN_FIELDS + optional_fields}
    seg = {
        n: np.full(seg_shape, -1, np.int32)
        for n in ("seg_traj_id", "seg_turn", "seg_prompt_len", "seg_response_len")
    }
    sample_index = np.full(seg_shape, -1, np.int32)
    for r, members in enumerate(rows):
        starts = row_starts([len(samples[i]) for i in members], sample_align, block_align,
                            limits)
        for k, (i, start) in enumerate(zip(members, starts, strict=True)):
            s, end = samples[i], start + len(samples[i])
            tokens[r, start:end] = s.tokens
            positions[r, start:end] = np.arange(len(s), dtype=np.int32)
            segment_ids[r, start:end] = k + 1
            for name, array in floats.items():
                array[r, start:end] = getattr(s, name)
            seg["seg_traj_id"][r, k] = s.traj_id
            seg["seg_turn"][r, k] = s.turn
            seg["seg_prompt_len"][r, k] = s.prompt_len
            seg["seg_response_len"][r, k] = s.response_len
            sample_index[r, k] = i
    optional = {n: floats.get(n) for n in _OPTIONAL_TOKEN_FIELDS}
    return PackedBatch(
        tokens=tokens,
        positions=positions,
        segment_ids=segment_ids,
        loss_mask=floats["loss_mask"],
        advantages=floats["advantages"],
        old_logprobs=floats["old_logprobs"],
        **optional,
        **seg,
        sample_index=sample_index,
        num_truncated=num_truncated,
        loss_slots=loss_slots,
    )


def resolve_num_rows(needed: int, num_rows: int | None, rows_bucket: int, what: str) -> int:
    if num_rows is None:
        return bucket_rows(needed, rows_bucket)
    if num_rows < needed:
        raise ValueError(f"{what} needs {needed} rows but num_rows={num_rows}")
    return num_rows


def pack_samples(
    samples: Sequence[Sample],
    *,
    micro_batch_max_tokens: int,
    sequence_length: int,
    rows_bucket: int = 0,
    num_rows: int | None = None,
    max_segments: int | None = None,
    pad_token_id: int = 0,
    loss_slots: int = 0,
    sample_align: int = 1,
    block_align: int = 0,
    row_prefixes: int = 0,
) -> PackedBatch:
    """Packs samples padding-free into ``[n_micro, micro_batch_max_tokens]`` rows.

    Each sample is cut to ``sequence_length`` tokens, then placed by first-fit-decreasing
    into rows of capacity ``micro_batch_max_tokens``. The row count is
    ``bucket_rows(rows_needed, rows_bucket)``, or exactly ``num_rows`` when given (so all
    mini-batches of a run share one shape); extra rows are all padding.

    Args:
      max_segments: cap on samples per row; also the width of the segment arrays. Default:
        the most used by any row, rounded up to a power of two.
      loss_slots: cap on loss tokens per row (0 = none; ``PackingConfig.loss_slots``). A
        sample with more loss tokens than that is a ``ValueError`` naming the setting.
      sample_align: each sample starts at a multiple of it (``PackingConfig.sample_align``).
      block_align, row_prefixes: a sample moves to the next multiple of ``block_align``
        where that saves attention block pairs and adds no computed slot (:func:`row_starts`;
        the row's computed lengths are :func:`prefix_lengths` ``(row, row_prefixes)``;
        ``PackingConfig.align_when_free``). 0 = packed tight.
    """
    if micro_batch_max_tokens < sequence_length:
        raise ValueError(
            f"micro_batch_max_tokens={micro_batch_max_tokens} must be >= "
            f"sequence_length={sequence_length} so that any sample fits in one row"
        )
    if not samples and num_rows is None:
        raise ValueError("pack_samples got no samples (pass num_rows for an all-padding batch)")
    if max_segments is not None and max_segments < 1:
        raise ValueError(f"max_segments={max_segments} must be >= 1")
    cut, num_truncated = truncate_samples(samples, sequence_length)
    optional = common_optional_fields(cut)
    loads = loss_loads(cut, [len(s) for s in cut], loss_slots)
    rows = first_fit_decreasing(
        footprints([len(s) for s in cut], sample_align, micro_batch_max_tokens),
        micro_batch_max_tokens, max_segments, loads=loads,
        load_capacity=loss_slots or micro_batch_max_tokens)
    width = max_segments or round_up_to_bucket(max((len(r) for r in rows), default=1))
    return assemble_batch(
        cut,
        rows,
        num_rows=resolve_num_rows(len(rows), num_rows, rows_bucket, "pack_samples"),
        row_len=micro_batch_max_tokens,
        max_segments=width,
        num_truncated=num_truncated,
        pad_token_id=pad_token_id,
        optional_fields=optional,
        loss_slots=loss_slots,
        sample_align=sample_align,
        block_align=block_align,
        limits=prefix_lengths(micro_batch_max_tokens, row_prefixes),
    )


def pack_tree(samples: Sequence[Sample], *, micro_batch_max_tokens: int, sequence_length: int,
              rows_bucket: int = 0, num_rows: int | None = None, pad_token_id: int = 0,
              loss_slots: int = 0) -> PackedBatch:
    """Tree packing (``data/tree_packing.py``): like :func:`pack_samples`, but each group of
    samples with one prompt writes it once per row and its continuations after it."""
    if not samples and num_rows is None:
        raise ValueError("pack_tree got no samples (pass num_rows for an all-padding batch)")
    cut, num_truncated = truncate_samples(samples, sequence_length)
    lengths = [len(s) for s in cut]
    loads = loss_loads(cut, lengths, loss_slots)
    parts, rows = tree_rows(cut, lengths, loads, micro_batch_max_tokens,
                            loss_slots or micro_batch_max_tokens)
    arrays = assemble_tree_rows(
        cut, parts, rows, num_rows=resolve_num_rows(len(rows), num_rows, rows_bucket,
                                                    "pack_tree"),
        row_len=micro_batch_max_tokens, pad_token_id=pad_token_id,
        optional_fields=common_optional_fields(cut))
    optional = {n: arrays.get(n) for n in _OPTIONAL_TOKEN_FIELDS}
    return PackedBatch(**{k: v for k, v in arrays.items() if k not in optional}, **optional,
                       num_truncated=num_truncated, loss_slots=loss_slots,
                       shared_saved=sum(p.saved() for p in parts))


def pad_rows(
    batch: PackedBatch, num_rows: int, max_segments: int | None = None, pad_token_id: int = 0
) -> PackedBatch:
    """Appends all-padding rows (and unused segment columns, -1) to reach the given shape."""
    if num_rows < batch.num_micro_batches:
        raise ValueError(f"pad_rows: batch has {batch.num_micro_batches} rows > {num_rows}")
    width = batch.sample_index.shape[1] if max_segments is None else max_segments
    if width < batch.sample_index.shape[1]:
        raise ValueError(f"pad_rows: batch has {batch.sample_index.shape[1]} segment columns")
    extra_rows = num_rows - batch.num_micro_batches
    extra_cols = width - batch.sample_index.shape[1]
    changes: dict[str, np.ndarray | None] = {}
    for field in dataclasses.fields(batch):
        value = getattr(batch, field.name)
        if not isinstance(value, np.ndarray):
            continue
        if field.name.startswith("seg_") or field.name == "sample_index":
            value = np.pad(value, ((0, extra_rows), (0, extra_cols)), constant_values=-1)
        else:
            fill = pad_token_id if field.name == "tokens" else 0
            value = np.pad(value, ((0, extra_rows), (0, 0)), constant_values=fill)
        changes[field.name] = value
    return dataclasses.replace(batch, **changes)


def spread_rows(batch: PackedBatch, shards: int) -> PackedBatch:
    """``batch`` with its rows reordered so that each of ``shards`` devices gets every
    ``shards``-th row: new row ``s·G + g`` is old row ``g·shards + s`` (``G`` = rows /
    shards).

    Why: the learner splits rows over devices in contiguous blocks (device ``s`` holds rows
    ``s·G … s·G + G − 1``) and scans them in groups of one row per device, skipping a group
    only when all of its rows are padding. Packing puts the real rows first, so without
    this device 0 would hold all of them while the others computed padding beside it: a
    mini-batch of 10 real rows in 16 on 2 devices ran 8 groups instead of 5.
    """
    rows = batch.num_micro_batches
    if shards <= 1:
        return batch
    if rows % shards:
        raise ValueError(f"spread_rows: {rows} rows are not a multiple of {shards} shards")
    order = np.arange(rows).reshape(rows // shards, shards).T.reshape(-1)
    return dataclasses.replace(batch, **{
        field.name: getattr(batch, field.name)[order] for field in dataclasses.fields(batch)
        if isinstance(getattr(batch, field.name), np.ndarray)})


def token_stats(batches: PackedBatch | Sequence[PackedBatch]) -> dict[str, float]:
    """Token accounting: what was computed versus what was real.

    Accepts one ``PackedBatch`` (each row is a micro-batch) or a list of them (each batch is
    a micro-batch, as from :func:`dynamic_batches`). Returns ``real_tokens`` (segment id >
    0), ``loss_tokens`` (Σ loss_mask), ``computed_slots`` (Σ rows × row_len, padding
    included), ``efficiency = real_tokens / computed_slots``, ``max_micro_batch_real_tokens``,
    ``padded_seq_len`` (longest row), ``num_micro_batches``, ``num_segments``,
    ``num_truncated`` and ``shared_saved`` (tokens tree packing did not compute).
    """
    if isinstance(batches, PackedBatch):
        per_micro = [int(n) for n in (batches.segment_ids > 0).sum(axis=1)]
        batches = [batches]
    else:
        per_micro = [int((b.segment_ids > 0).sum()) for b in batches]
    real = sum(per_micro)
    slots = sum(b.tokens.size for b in batches)
    return {
        "real_tokens": float(real),
        "loss_tokens": float(sum(b.loss_mask.sum() for b in batches)),
        "computed_slots": float(slots),
        "efficiency": real / slots if slots else 0.0,
        "max_micro_batch_real_tokens": float(max(per_micro, default=0)),
        "padded_seq_len": float(max((b.row_len for b in batches), default=0)),
        "num_micro_batches": float(len(per_micro)),
        "num_segments": float(sum((b.sample_index >= 0).sum() for b in batches)),
        "num_truncated": float(sum(b.num_truncated for b in batches)),
        "shared_saved": float(sum(b.shared_saved for b in batches)),
    }
