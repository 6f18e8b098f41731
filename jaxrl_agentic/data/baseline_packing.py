"""The padded layouts that padding-free packing is measured against (``scripts/bench``).

Not part of the training path: the learner only packs (``data/packing.py``). Both layouts
return the same :class:`~jaxrl_agentic.data.packing.PackedBatch` contract, so a learner step
can run on either and the benchmark compares like with like:

* :func:`pad_samples` — the classic padded layout, one sample per row, row length bucketed
  from the longest sample. Each row is one micro-batch.
* :func:`dynamic_batches` — padded rows grouped by similar length; each returned
  ``PackedBatch`` is one micro-batch of ``rows × row_len <= max_tokens_per_micro_batch``.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

from jaxrl_agentic.data.buckets import bucket_rows, round_up_to_bucket
from jaxrl_agentic.data.packing import (
    PackedBatch,
    assemble_batch,
    common_optional_fields,
    resolve_num_rows,
    truncate_samples,
)
from jaxrl_agentic.data.types import Sample


def _padded_row_len(longest: int, length_bucket: int, limit: int | None) -> int:
    row_len = round_up_to_bucket(longest, length_bucket)
    return row_len if limit is None else max(longest, min(row_len, limit))


def pad_samples(
    samples: Sequence[Sample],
    *,
    sequence_length: int,
    length_bucket: int = 0,
    rows_bucket: int = 0,
    num_rows: int | None = None,
    pad_token_id: int = 0,
) -> PackedBatch:
    """Padded layout: one sample per row (segment id 1), right-padded.

    Row length is the longest (truncated) sample rounded up by ``length_bucket`` (0 = power
    of two), capped at ``sequence_length``. Row count is bucketed like :func:`pack_samples`.
    """
    if not samples:
        raise ValueError("pad_samples got no samples")
    cut, num_truncated = truncate_samples(samples, sequence_length)
    longest = max(len(s) for s in cut)
    return assemble_batch(
        cut,
        [[i] for i in range(len(cut))],
        num_rows=resolve_num_rows(len(cut), num_rows, rows_bucket, "pad_samples"),
        row_len=_padded_row_len(longest, length_bucket, sequence_length),
        max_segments=1,
        num_truncated=num_truncated,
        pad_token_id=pad_token_id,
        optional_fields=common_optional_fields(cut),
    )


def dynamic_batches(
    samples: Sequence[Sample],
    max_tokens_per_micro_batch: int,
    *,
    sequence_length: int | None = None,
    length_bucket: int = 0,
    rows_bucket: int = 0,
    pad_token_id: int = 0,
) -> list[PackedBatch]:
    """Padded micro-batches of similar-length samples, each within a token budget.

    Samples are sorted by decreasing length. A micro-batch opened by a sample of length
    ``l`` gets rows of ``row_len = bucket(l)`` and room for ``C = max_tokens // row_len``
    rows; it takes the next ``C`` samples in order (all no longer than ``l``). So every
    micro-batch but the last is full, and a sample sits in a row longer than its own bucket
    only at the ``< C`` boundary places per length bucket. The last micro-batch's row count
    is bucketed (``min(C, bucket_rows(k))``). Shapes are ``[rows, row_len]`` with few distinct
    values: one per (length bucket, row bucket).

    Each returned batch is one micro-batch (its rows are processed together), unlike
    :func:`pack_samples` / :func:`pad_samples` where each row is a micro-batch.
    """
    if sequence_length is not None and max_tokens_per_micro_batch < sequence_length:
        raise ValueError(
            f"max_tokens_per_micro_batch={max_tokens_per_micro_batch} must be >= "
            f"sequence_length={sequence_length} so that any sample fits in one micro-batch"
        )
    cut, num_truncated = truncate_samples(samples, sequence_length)
    lengths = np.array([len(s) for s in cut], dtype=np.int64)
    if np.any(lengths > max_tokens_per_micro_batch):
        raise ValueError(
            f"a sample of {lengths.max()} tokens exceeds "
            f"max_tokens_per_micro_batch={max_tokens_per_micro_batch}; set sequence_length"
        )
    optional = common_optional_fields(cut)
    limit = max_tokens_per_micro_batch if sequence_length is None else sequence_length
    order = np.argsort(-lengths, kind="stable")
    batches, start = [], 0
    while start < len(order):
        row_len = _padded_row_len(int(lengths[order[start]]), length_bucket, limit)
        capacity = max_tokens_per_micro_batch // row_len
        members = order[start : start + capacity]
        start += len(members)
        batch = assemble_batch(
            cut,
            [[int(i)] for i in members],
            num_rows=min(capacity, bucket_rows(len(members), rows_bucket)),
            row_len=row_len,
            max_segments=1,
            num_truncated=0,
            pad_token_id=pad_token_id,
            optional_fields=optional,
        )
        batches.append(batch)
    if batches:
        # Counted once for the whole call so summing over micro-batches is right.
        batches[0].num_truncated = num_truncated
    return batches
