"""Mini-batch splitting and shape-stable packing of a pipeline step."""

import math

import numpy as np
import pytest

from jaxrl_agentic.data import PackingConfig
from jaxrl_agentic.data.buckets import bucket_rows
from jaxrl_agentic.data.minibatch import pack_minibatches, split_minibatches, updates_per_step
from jaxrl_agentic.data.packing import pack_samples
from jaxrl_agentic.data.types import Sample


def samples_of_lengths(lengths):
    return [
        Sample(
            tokens=np.arange(n) + 100 * i,
            loss_mask=np.r_[np.zeros(1), np.ones(n - 1)],
            old_logprobs=np.r_[np.zeros(1), -np.ones(n - 1)],
            advantages=np.full(n, float(i)),
            traj_id=i,
            prompt_len=1,
        )
        for i, n in enumerate(lengths)
    ]


@pytest.mark.parametrize("n, mbs, epochs", [(1, 4, 1), (8, 4, 2), (10, 4, 3), (7, 7, 1), (5, 8, 2)])
def test_split_count_and_each_epoch_is_a_permutation(n, mbs, epochs):
    samples = samples_of_lengths([3] * n)
    minibatches = split_minibatches(samples, mbs, epochs, np.random.default_rng(0))
    per_epoch = math.ceil(n / mbs)
    assert len(minibatches) == epochs * per_epoch == updates_per_step(n, mbs, epochs)
    for e in range(epochs):
        epoch = minibatches[e * per_epoch : (e + 1) * per_epoch]
        assert [len(mb) for mb in epoch[:-1]] == [mbs] * (per_epoch - 1)
        assert sorted(s.traj_id for mb in epoch for s in mb) == list(range(n))


def test_split_shuffles_and_is_reproducible():
    samples = samples_of_lengths([3] * 32)
    first = split_minibatches(samples, 8, 4, np.random.default_rng(1))
    again = split_minibatches(samples, 8, 4, np.random.default_rng(1))
    orders = [[s.traj_id for mb in first[e * 4 : e * 4 + 4] for s in mb] for e in range(4)]
    assert orders == [[s.traj_id for mb in again[e * 4 : e * 4 + 4] for s in mb] for e in range(4)]
    assert len({tuple(o) for o in orders}) == 4  # each epoch shuffled anew
    assert orders[0] != list(range(32))


def test_split_rejects_bad_arguments():
    with pytest.raises(ValueError, match="mini_batch_size >= 1"):
        split_minibatches(samples_of_lengths([3]), 0, 1, np.random.default_rng(0))


def test_pack_minibatches_share_one_bucketed_shape():
    samples = samples_of_lengths([9, 2, 7, 3, 8, 8, 1, 5, 6, 4])
    minibatches = split_minibatches(samples, 4, 2, np.random.default_rng(3))
    packed = pack_minibatches(minibatches, PackingConfig(micro_batch_max_tokens=12,
                                                         sequence_length=10, rows_bucket=0,
                                                         fixed_rows=False), mini_batch_size=4)
    # reference: pack each one on its own with exact row counts, then take the bucket of the max
    alone = [
        pack_samples(mb, micro_batch_max_tokens=12, sequence_length=10, rows_bucket=1)
        for mb in minibatches
    ]
    rows = bucket_rows(max(b.num_micro_batches for b in alone))
    assert {b.tokens.shape for b in packed} == {(rows, 12)}
    assert len({b.sample_index.shape for b in packed}) == 1
    for b, ref, mb in zip(packed, alone, minibatches, strict=True):
        n = ref.num_micro_batches
        np.testing.assert_array_equal(b.tokens[:n], ref.tokens)
        np.testing.assert_array_equal(b.segment_ids[:n], ref.segment_ids)
        assert not b.segment_ids[n:].any() and not b.loss_mask[n:].any()
        assert b.loss_mask.sum() == sum(s.num_loss_tokens for s in mb)


def test_pack_minibatches_fixed_count_and_overflow_error():
    minibatches = [samples_of_lengths([10, 10, 10])]
    packing = PackingConfig(micro_batch_max_tokens=10, sequence_length=10, fixed_rows=True)
    packed = pack_minibatches(minibatches, packing, mini_batch_size=5)
    assert packed[0].tokens.shape == (5, 10)
    # Rows are a multiple of the mesh's batch shards too.
    assert pack_minibatches(minibatches, packing, mini_batch_size=5,
                            rows_multiple=4)[0].tokens.shape == (8, 10)
    with pytest.raises(ValueError, match="needs 3 micro-batches but mini_batch_size=2"):
        pack_minibatches(minibatches, packing, mini_batch_size=2)


def test_pack_minibatches_spread_real_rows_over_the_shards():
    """Device s holds rows s·G … s·G + G − 1 and the learner scans one row per device at a
    time, skipping only all-padding groups: 5 real rows of 8 on 2 shards must take
    ceil(5/2) = 3 groups, not 4 (all real rows on device 0, as packing lays them out)."""
    minibatches = [samples_of_lengths([10, 10, 10, 10, 10])]
    packing = PackingConfig(micro_batch_max_tokens=10, sequence_length=10, fixed_rows=True)
    alone = pack_minibatches(minibatches, packing, mini_batch_size=8)[0]
    spread = pack_minibatches(minibatches, packing, mini_batch_size=8, rows_multiple=2)[0]
    busy = (spread.segment_ids > 0).any(axis=1)
    assert busy.reshape(2, 4).sum(axis=1).tolist() == [3, 2]  # real rows per device
    assert busy.reshape(2, 4).any(axis=0).sum() == 3  # groups the scan runs
    # The same rows, only reordered: new row s·4 + g is old row 2·g + s.
    order = [0, 2, 4, 6, 1, 3, 5, 7]
    np.testing.assert_array_equal(spread.tokens, alone.tokens[order])
    np.testing.assert_array_equal(spread.sample_index, alone.sample_index[order])
