"""The padded baselines the packing benchmark measures against: hand examples and invariants."""


import numpy as np
from hypothesis import given, settings
from hypothesis import strategies as st

from jaxrl_agentic.data.baseline_packing import dynamic_batches, pad_samples
from jaxrl_agentic.data.packing import PackedBatch, token_stats
from tests.data.test_packing import assert_contract, samples_of_lengths


def test_pad_samples_hand_example():
    samples = samples_of_lengths([3, 5, 2])
    batch = pad_samples(samples, sequence_length=16)
    assert batch.tokens.shape == (4, 8)  # row length 5 -> 8, rows 3 -> 4
    np.testing.assert_array_equal(
        batch.segment_ids[:, :6],
        [[1, 1, 1, 0, 0, 0], [1, 1, 1, 1, 1, 0], [1, 1, 0, 0, 0, 0], [0, 0, 0, 0, 0, 0]],
    )
    np.testing.assert_array_equal(batch.sample_index, [[0], [1], [2], [-1]])
    assert_contract(batch, samples, 16)
    stats = token_stats(batch)
    assert (stats["real_tokens"], stats["computed_slots"], stats["padded_seq_len"]) == (10, 32, 8)
    assert stats["max_micro_batch_real_tokens"] == 5
    # multiple-of-3 length bucket; the cap at sequence_length wins over the bucket
    assert pad_samples(samples, sequence_length=16, length_bucket=3).row_len == 6
    capped = pad_samples(samples_of_lengths([7, 2]), sequence_length=6)
    assert capped.row_len == 6 and capped.num_truncated == 1


def test_dynamic_batches_hand_example():
    # sorted: 10,9 | 3,3,2,2,2,1. Bucket(10)=16 -> 32//16 = 2 rows; bucket(3)=4 -> 8 rows,
    # 6 samples -> min(8, bucket_rows(6)=8) rows.
    lengths = [2, 10, 3, 1, 9, 2, 3, 2]
    samples = samples_of_lengths(lengths)
    batches = dynamic_batches(samples, 32)
    assert [b.tokens.shape for b in batches] == [(2, 16), (8, 4)]
    np.testing.assert_array_equal(batches[0].sample_index[:, 0], [1, 4])
    np.testing.assert_array_equal(batches[1].sample_index[:, 0], [2, 6, 0, 5, 7, 3, -1, -1])
    stats = token_stats(batches)
    assert stats["real_tokens"] == sum(lengths) == 32
    assert stats["computed_slots"] == 64 and stats["num_micro_batches"] == 2
    assert stats["max_micro_batch_real_tokens"] == 19 and stats["padded_seq_len"] == 16


@settings(max_examples=30, deadline=None)
@given(
    lengths=st.lists(st.integers(1, 64), min_size=1, max_size=40),
    budget=st.sampled_from([64, 100, 256]),
)
def test_dynamic_batches_cover_every_sample_within_budget(lengths, budget):
    samples = samples_of_lengths(lengths)
    batches = dynamic_batches(samples, budget, sequence_length=48)
    seen = []
    for b in batches:
        assert b.tokens.size <= budget
        assert set(np.unique(b.segment_ids)) <= {0, 1}
        seen += [int(i) for i in b.sample_index[:, 0] if i >= 0]
        sub = [samples[i] for i in b.sample_index[:, 0] if i >= 0]
        remapped = dataclass_with_local_index(b)
        assert_contract(remapped, sub, 48)
    assert sorted(seen) == list(range(len(samples)))
    assert token_stats(batches)["num_truncated"] == sum(n > 48 for n in lengths)
    # never worse than padding every sample to the longest (per-sample bucketed) length
    assert token_stats(batches)["computed_slots"] <= budget * len(samples)


def dataclass_with_local_index(batch):
    """Renumbers sample_index to positions within this micro-batch (for assert_contract)."""
    local = batch.sample_index.copy()
    local[local >= 0] = np.arange((local >= 0).sum())
    return PackedBatch(**{**batch.__dict__, "sample_index": local})


def test_dynamic_batching_wastes_less_than_padding_on_skewed_lengths():
    lengths = [200] * 2 + [20] * 30
    samples = samples_of_lengths(lengths)
    padded = token_stats(pad_samples(samples, sequence_length=256))
    dynamic = token_stats(dynamic_batches(samples, 512, sequence_length=256))
    # padded: 32 rows × 256. dynamic: [2, 256], then rows of 32 with room for 512 // 32 = 16:
    # 16 short samples, then 14 in a batch bucketed to 16 rows.
    assert padded["computed_slots"] == 32 * 256
    assert dynamic["computed_slots"] == 2 * 256 + 16 * 32 + 16 * 32
    assert dynamic["efficiency"] > 2 * padded["efficiency"]


