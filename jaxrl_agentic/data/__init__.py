"""Training data: samples, packing into fixed-shape batches, mini-batch splitting."""

from jaxrl_agentic.data.buckets import (
    bucket_rows,
    first_fit_decreasing,
    prefix_lengths,
    round_up_to_bucket,
    row_starts,
)
from jaxrl_agentic.data.minibatch import pack_minibatches, split_minibatches, updates_per_step
from jaxrl_agentic.data.packing import (
    PackedBatch,
    PackingConfig,
    pack_samples,
    pad_rows,
    spread_rows,
    token_stats,
)
from jaxrl_agentic.data.types import Sample, trained_loss_mask, truncate_sample

__all__ = [
    "PackedBatch",
    "PackingConfig",
    "Sample",
    "bucket_rows",
    "first_fit_decreasing",
    "pack_minibatches",
    "pack_samples",
    "pad_rows",
    "prefix_lengths",
    "round_up_to_bucket",
    "row_starts",
    "split_minibatches",
    "spread_rows",
    "token_stats",
    "trained_loss_mask",
    "truncate_sample",
    "updates_per_step",
]
