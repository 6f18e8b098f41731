"""Per-token passes without a gradient: logprobs and values over packed samples.

:func:`make_per_token` jits a function of a group of rows into a program over a whole
packed batch (scanned as the update scans it, ``accumulation.scan_row_groups``);
:func:`per_sample_outputs` packs samples, runs such a program and hands back one array per
sample; :func:`computed_slots` counts the token slots a step really computes.
"""

from __future__ import annotations

from collections.abc import Sequence

import jax
import numpy as np

from jaxrl_agentic.data import (
    PackedBatch,
    PackingConfig,
    Sample,
    bucket_rows,
    prefix_lengths,
    round_up_to_bucket,
)
from jaxrl_agentic.runtime.parallel import batch_sharding, num_batch_shards, to_host
from jaxrl_agentic.training.accumulation import row_halvings, scan_row_groups
from jaxrl_agentic.training.update import kernels_see_mesh, pad_to_shards, put_batch


def make_per_token(fn, keys: Sequence[str], mesh, param_shardings, halvings: int = 0,
                   compiler_options: dict | None = None):
    """Jitted ``compute(params, batch) -> [n_micro, row_len]`` fp32 from ``fn(params, micro)
    -> [group_rows, T]`` run on groups of rows (:func:`scan_row_groups`, cut to prefixes of
    up to ``halvings`` halvings); reads ``keys``; ``compiler_options`` as
    :func:`make_update_step`'s."""

    @kernels_see_mesh(mesh)
    def compute(params, batch):
        return scan_row_groups(lambda micro: fn(params, micro), {k: batch[k] for k in keys},
                               mesh, halvings)

    return jax.jit(
        compute,
        in_shardings=(param_shardings, batch_sharding(mesh)),
        out_shardings=batch_sharding(mesh),
        compiler_options=compiler_options,
    )


def computed_slots(batch: PackedBatch, mesh, halvings: int = 0) -> int:
    """Token slots a step really computes: the scan skips groups of rows (one per batch
    shard, rows ``j, j + groups, …``) that hold only padding and runs each other group on
    its prefix (:func:`on_shortest_prefix`, ``halvings`` as ``PackingConfig.row_prefixes``).
    A mini-batch of one group is differentiated whole (:func:`accumulate_gradient_sums`)."""
    shards = num_batch_shards(mesh)
    groups = batch.num_micro_batches // shards
    halvings = row_halvings(mesh, halvings) if groups > 1 else 0
    lengths = np.asarray(prefix_lengths(batch.row_len, halvings))
    busy = (batch.segment_ids > 0).reshape(shards, groups, -1).any(axis=0)  # [groups, T]
    used = np.where(busy, np.arange(1, batch.row_len + 1), 0).max(axis=1, initial=0)
    cut = np.where(used > 0, lengths[np.searchsorted(lengths, used)], 0)
    return int(cut.sum()) * shards


def per_sample_outputs(samples: Sequence[Sample], packing: PackingConfig, mesh, compute,
                       params, keys: Sequence[str]) -> list[np.ndarray]:
    """Per-sample ``[len(sample)]`` fp32 results of a jitted per-token ``compute(params,
    batch) -> [n_micro, row_len]`` run on ``samples`` packed for ``mesh``; 0 beyond
    ``sequence_length``."""
    num_rows = None
    if packing.fixed_rows:  # one sample per row at most: a shape that follows only n
        num_rows = round_up_to_bucket(bucket_rows(len(samples), 0), num_batch_shards(mesh))
    batch = pad_to_shards(packing.pack(samples, num_rows=num_rows), mesh, packing.pad_token_id)
    per_token = to_host(compute(params, put_batch(batch, keys, mesh)))
    out = [np.zeros(len(s), np.float32) for s in samples]
    for row, column in zip(*np.nonzero(batch.sample_index >= 0), strict=True):
        values = per_token[row][batch.segment_ids[row] == column + 1]
        # A tree-packed continuation starts `seg_offset` tokens into its sample (the shared
        # prefix before it is no sample's: sample_index −1).
        start = 0 if batch.seg_offset is None else int(batch.seg_offset[row, column])
        out[batch.sample_index[row, column]][start:start + len(values)] = values
    return out
