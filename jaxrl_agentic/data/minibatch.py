"""Splitting one pipeline step's samples into PPO mini-batches, and packing them.

One mini-batch = one optimizer update. A step with ``n`` samples therefore makes

    updates_per_step(n) = ppo_epochs · ceil(n / mini_batch_size)

updates; this is the count the LR schedule's progress and ``optim/num_updates`` use.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import numpy as np

from jaxrl_agentic.data.buckets import bucket_rows, round_up_to_bucket
from jaxrl_agentic.data.packing import PackedBatch, PackingConfig, pad_rows, spread_rows
from jaxrl_agentic.data.tree_packing import prompt_groups
from jaxrl_agentic.data.types import Sample


def updates_per_step(num_samples: int, mini_batch_size: int, ppo_epochs: int) -> int:
    """``ppo_epochs · ceil(num_samples / mini_batch_size)``: optimizer updates in one step."""
    if mini_batch_size < 1 or ppo_epochs < 1 or num_samples < 0:
        raise ValueError(
            f"need mini_batch_size >= 1, ppo_epochs >= 1, num_samples >= 0; got "
            f"{mini_batch_size}, {ppo_epochs}, {num_samples}"
        )
    return ppo_epochs * math.ceil(num_samples / mini_batch_size)


def split_minibatches(
    samples: Sequence[Sample], mini_batch_size: int, ppo_epochs: int, rng: np.random.Generator,
    *, keep_groups: bool = False,
) -> list[list[Sample]]:
    """Shuffles the samples once per epoch and cuts each epoch into mini-batches.

    Returns ``ppo_epochs · ceil(n / mini_batch_size)`` lists; within an epoch every sample
    appears exactly once and only the last mini-batch may be smaller. The reductions
    normalise per mini-batch, so a short last mini-batch is still an unbiased update.
    ``keep_groups``: the shuffle moves whole prompt groups (``tree_packing.prompt_groups``:
    the samples that begin with one first prompt, a GRPO group; members in their order), so
    a group is cut only where a mini-batch boundary falls inside it: what tree packing needs
    to find a group's members together. Groups that share only their instructions are
    separate units, so each epoch and seed draws its own mini-batches.
    """
    updates_per_step(len(samples), mini_batch_size, ppo_epochs)  # validates arguments
    groups = prompt_groups(samples) if keep_groups else None
    minibatches = []
    for _ in range(ppo_epochs):
        if groups is None:
            order = rng.permutation(len(samples))
        else:
            order = [i for g in rng.permutation(len(groups)) for i in groups[g]]
        for start in range(0, len(samples), mini_batch_size):
            minibatches.append([samples[i] for i in order[start : start + mini_batch_size]])
    return minibatches


def pack_minibatches(
    minibatches: Sequence[Sequence[Sample]],
    packing: PackingConfig,
    *,
    mini_batch_size: int,
    rows_multiple: int = 1,
) -> list[PackedBatch]:
    """Packs each mini-batch and pads them all to one shape for the learner's ``lax.scan``.

    The common micro-batch (row) count is a multiple of ``rows_multiple`` (the mesh's batch
    shards): with ``packing.fixed_rows`` it is ``mini_batch_size`` rounded up (a mini-batch
    never needs more rows than samples, as each fits one row), so the shape never changes
    within a run; otherwise ``bucket_rows(most rows needed, rows_bucket)`` rounded up. The
    segment-metadata width is the largest one. Padding micro-batches have segment ids 0
    everywhere, so they add nothing to any loss sum or denominator. With several shards the
    rows are then spread over them (:func:`~jaxrl_agentic.data.packing.spread_rows`), so
    every device gets its share of the real rows.
    """
    # Exact row counts here; the common bucket is applied below. Each mini-batch gets its
    # own row length (``PackingConfig.row_len_buckets``); an update step is one call.
    packed = [packing.pack(mb, rows_bucket=1) for mb in minibatches]
    needed = max((b.num_micro_batches for b in packed), default=0)
    if packing.fixed_rows:
        if needed > mini_batch_size:
            raise ValueError(f"a mini-batch needs {needed} micro-batches but mini_batch_size="
                             f"{mini_batch_size} (one row per sample at most)")
        num_rows = round_up_to_bucket(mini_batch_size, rows_multiple)
    else:
        num_rows = round_up_to_bucket(bucket_rows(needed, packing.rows_bucket), rows_multiple)
    width = max((b.sample_index.shape[1] for b in packed), default=1)
    return [spread_rows(pad_rows(b, num_rows, width, packing.pad_token_id), rows_multiple)
            for b in packed]
