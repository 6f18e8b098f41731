"""Padding-free packing: hand examples plus brute-force invariants."""

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from jaxrl_agentic.data import buckets
from jaxrl_agentic.data.buckets import bucket_rows, loss_slots_bucket, round_up_to_bucket
from jaxrl_agentic.data.packing import (
    PackedBatch,
    PackingConfig,
    pack_samples,
    pad_rows,
    token_stats,
)
from jaxrl_agentic.data.types import Sample, truncate_sample


def make_sample(length, prompt_len, seed, traj_id=0, turn=0, with_ref=False):
    """A sample whose tokens encode (traj_id, index) so misplaced tokens are detectable."""
    rng = np.random.default_rng(seed)
    mask = np.zeros(length, np.float32)
    mask[prompt_len:] = rng.random(length - prompt_len) < 0.8
    logp = np.where(mask > 0, -rng.random(length), 0.0)
    return Sample(
        tokens=1000 * (traj_id + 1) + np.arange(length),
        loss_mask=mask,
        old_logprobs=logp,
        advantages=rng.normal(size=length),
        ref_logprobs=np.where(mask > 0, logp - 0.1, 0.0) if with_ref else None,
        traj_id=traj_id,
        turn=turn,
        prompt_len=prompt_len,
    )


def samples_of_lengths(lengths, with_ref=False):
    return [
        make_sample(n, n // 3, seed=i, traj_id=i, turn=i % 3, with_ref=with_ref)
        for i, n in enumerate(lengths)
    ]


def reference_ffd(lengths, capacity):
    """Textbook first-fit-decreasing on python lists (independent of the numpy version)."""
    order = sorted(range(len(lengths)), key=lambda i: (-lengths[i], i))
    bins, loads = [], []
    for i in order:
        for b, load in enumerate(loads):
            if load + lengths[i] <= capacity:
                bins[b].append(i)
                loads[b] += lengths[i]
                break
        else:
            bins.append([i])
            loads.append(lengths[i])
    return sorted(sorted(b) for b in bins)


def segments_of(batch: PackedBatch):
    """{sample_index: (row, segment_id)} read back from the batch."""
    found = {}
    for r, k in zip(*np.nonzero(batch.sample_index >= 0), strict=True):
        found[int(batch.sample_index[r, k])] = (int(r), int(k) + 1)
    return found


def assert_contract(batch: PackedBatch, samples, sequence_length):
    """Every sample appears once, intact up to truncation, with restarting positions."""
    found = segments_of(batch)
    assert sorted(found) == list(range(len(samples)))
    assert (batch.sample_index >= 0).sum() == len(samples)
    for i, (r, seg) in found.items():
        ref, _ = truncate_sample(samples[i], sequence_length)
        where = batch.segment_ids[r] == seg
        np.testing.assert_array_equal(batch.tokens[r, where], ref.tokens)
        np.testing.assert_array_equal(batch.positions[r, where], np.arange(len(ref)))
        np.testing.assert_array_equal(batch.loss_mask[r, where], ref.loss_mask)
        np.testing.assert_array_equal(batch.advantages[r, where], ref.advantages)
        np.testing.assert_array_equal(batch.old_logprobs[r, where], ref.old_logprobs)
        k = seg - 1
        assert batch.seg_traj_id[r, k] == ref.traj_id and batch.seg_turn[r, k] == ref.turn
        assert batch.seg_prompt_len[r, k] == ref.prompt_len
        assert batch.seg_response_len[r, k] == len(ref) - ref.prompt_len
        # contiguous: one segment never splits, so the reductions' per-segment counts are exact
        idx = np.nonzero(where)[0]
        assert idx[-1] - idx[0] + 1 == len(idx)
    pad = batch.segment_ids == 0
    for name, array in batch.token_arrays().items():
        assert array.shape == batch.tokens.shape
        assert not np.any(array[pad]), name
    unused = batch.sample_index < 0
    for array in (batch.seg_traj_id, batch.seg_turn, batch.seg_prompt_len):
        assert np.all(array[unused] == -1)


@pytest.mark.parametrize(
    "n, bucket, expected",
    [
        (0, 0, 0),
        (1, 0, 1),
        (2, 0, 2),
        (3, 0, 4),
        (5, 0, 8),
        (8, 0, 8),
        (9, 0, 16),
        (1, 4, 4),
        (4, 4, 4),
        (5, 4, 8),
        (13, 6, 18),
    ],
)
def test_bucket_rows_table(n, bucket, expected):
    assert bucket_rows(n, bucket) == expected == round_up_to_bucket(n, bucket)


def test_pack_hand_example():
    # lengths 5,3,4,2,6 into rows of 8. FFD order (sample index in brackets)
    # 6[4], 5[0], 4[2], 3[1], 2[3]:
    # [4] -> row0 (room 2), [0] -> row1 (room 3), [2] -> row2, [1] -> row1, [3] -> row0.
    samples = samples_of_lengths([5, 3, 4, 2, 6])
    batch = pack_samples(samples, micro_batch_max_tokens=8, sequence_length=8)
    assert batch.tokens.shape == (4, 8)  # 3 rows used, bucketed to 4
    np.testing.assert_array_equal(
        batch.segment_ids,
        [[1, 1, 2, 2, 2, 2, 2, 2], [1, 1, 1, 1, 1, 2, 2, 2], [1, 1, 1, 1, 0, 0, 0, 0], [0] * 8],
    )
    np.testing.assert_array_equal(
        batch.positions,
        [[0, 1, 0, 1, 2, 3, 4, 5], [0, 1, 2, 3, 4, 0, 1, 2], [0, 1, 2, 3, 0, 0, 0, 0], [0] * 8],
    )
    np.testing.assert_array_equal(batch.tokens[2], [3000, 3001, 3002, 3003, 0, 0, 0, 0])
    np.testing.assert_array_equal(batch.sample_index, [[3, 4], [0, 1], [2, -1], [-1, -1]])
    np.testing.assert_array_equal(batch.seg_prompt_len, [[0, 2], [1, 1], [1, -1], [-1, -1]])
    np.testing.assert_array_equal(batch.seg_response_len, [[2, 4], [4, 2], [3, -1], [-1, -1]])
    assert batch.ref_logprobs is None and batch.num_truncated == 0
    assert_contract(batch, samples, 8)

    stats = token_stats(batch)
    assert stats == {
        "real_tokens": 20.0,
        "loss_tokens": float(sum(s.num_loss_tokens for s in samples)),
        "computed_slots": 32.0,
        "efficiency": 20 / 32,
        "max_micro_batch_real_tokens": 8.0,
        "padded_seq_len": 8.0,
        "num_micro_batches": 4.0,
        "num_segments": 5.0,
        "num_truncated": 0.0,
        "shared_saved": 0.0,
    }


@settings(max_examples=40, deadline=None)
@given(
    lengths=st.lists(st.integers(1, 40), min_size=1, max_size=30),
    capacity=st.integers(24, 64),
    rows_bucket=st.sampled_from([0, 1, 3]),
)
def test_pack_matches_reference_ffd_and_contract(lengths, capacity, rows_bucket):
    sequence_length = 24
    samples = samples_of_lengths(lengths, with_ref=True)
    batch = pack_samples(
        samples,
        micro_batch_max_tokens=capacity,
        sequence_length=sequence_length,
        rows_bucket=rows_bucket,
    )
    cut = [min(n, sequence_length) for n in lengths]
    expected_rows = reference_ffd(cut, capacity)
    got_rows = sorted(
        sorted(int(i) for i in row if i >= 0) for row in batch.sample_index if np.any(row >= 0)
    )
    assert got_rows == expected_rows
    assert batch.tokens.shape == (bucket_rows(len(expected_rows), rows_bucket), capacity)
    assert batch.num_truncated == sum(n > sequence_length for n in lengths)
    assert token_stats(batch)["real_tokens"] == sum(cut)
    assert_contract(batch, samples, sequence_length)
    for i, (r, seg) in segments_of(batch).items():
        ref, _ = truncate_sample(samples[i], sequence_length)
        np.testing.assert_array_equal(
            batch.ref_logprobs[r, batch.segment_ids[r] == seg], ref.ref_logprobs
        )


def test_pack_rejects_row_shorter_than_sequence_with_both_names():
    with pytest.raises(ValueError, match="micro_batch_max_tokens=8.*sequence_length=16"):
        pack_samples(samples_of_lengths([3]), micro_batch_max_tokens=8, sequence_length=16)


def test_pack_fixed_num_rows_and_segment_cap():
    samples = samples_of_lengths([2, 2, 2, 2, 2])
    batch = pack_samples(
        samples, micro_batch_max_tokens=16, sequence_length=8, num_rows=5, max_segments=2
    )
    # capacity would fit all five in one row; the cap of 2 segments makes 3 rows
    assert batch.tokens.shape == (5, 16) and batch.sample_index.shape == (5, 2)
    assert [int((row >= 0).sum()) for row in batch.sample_index] == [2, 2, 1, 0, 0]
    assert_contract(batch, samples, 8)
    with pytest.raises(ValueError, match="needs 3 rows but num_rows=2"):
        pack_samples(
            samples, micro_batch_max_tokens=16, sequence_length=8, num_rows=2, max_segments=2
        )


def test_pack_counts_truncations_and_drops_tail_masks():
    samples = samples_of_lengths([12, 5, 9])
    batch = pack_samples(samples, micro_batch_max_tokens=10, sequence_length=8)
    assert batch.num_truncated == 2
    assert token_stats(batch)["real_tokens"] == 8 + 5 + 8
    assert batch.loss_mask.sum() == sum(truncate_sample(s, 8)[0].num_loss_tokens for s in samples)
    assert_contract(batch, samples, 8)


def test_pack_rejects_mixed_optional_fields():
    samples = [make_sample(4, 1, 0, with_ref=True), make_sample(4, 1, 1)]
    with pytest.raises(ValueError, match="ref_logprobs is set on 1 of 2 samples"):
        pack_samples(samples, micro_batch_max_tokens=8, sequence_length=8)


def test_pad_rows_adds_empty_rows_and_columns():
    batch = pack_samples(samples_of_lengths([3, 4]), micro_batch_max_tokens=8, sequence_length=8)
    grown = pad_rows(batch, 4, max_segments=3)
    assert grown.tokens.shape == (4, 8) and grown.sample_index.shape == (4, 3)
    np.testing.assert_array_equal(grown.tokens[:1], batch.tokens)
    assert not grown.segment_ids[1:].any() and np.all(grown.seg_turn[:, 2] == -1)
    with pytest.raises(ValueError):
        pad_rows(batch, 0)


def test_packing_config_states_its_rules_with_the_field_name():
    with pytest.raises(ValueError, match="^row_len_ratio: must be > 1"):
        PackingConfig(row_len_ratio=1.0)
    with pytest.raises(ValueError, match="^micro_batch_max_tokens: 100 < sequence_length=200"):
        PackingConfig(micro_batch_max_tokens=100, sequence_length=200)
    with pytest.raises(ValueError, match="^rows_bucket: must be >= 0"):
        PackingConfig(rows_bucket=-1)
    samples = samples_of_lengths([5, 7, 3])
    config = PackingConfig(micro_batch_max_tokens=8, sequence_length=8, rows_bucket=3)
    packed, reference = config.pack(samples), pack_samples(
        samples, micro_batch_max_tokens=8, sequence_length=8, rows_bucket=3)
    np.testing.assert_array_equal(packed.tokens, reference.tokens)


# Row lengths by hand: 128 / r^i rounded up to a multiple of 16 (r = 2: exact halvings).
ROW_GRIDS = {2.0: (128, 64, 32, 16), 2 ** 0.25: (128, 112, 96, 80, 64, 64, 48, 48)}


@pytest.mark.parametrize("ratio", sorted(ROW_GRIDS))
@pytest.mark.parametrize("seed", range(6))
def test_row_length_bucket_is_the_cheapest_that_fits(seed, ratio):
    """`row_len_buckets` k lengths 128 / ratio^i; the chosen one computes the fewest slots
    (rows × length, brute force over the hand-listed candidates with the textbook FFD), the
    longest on ties, and a sample never needs a row shorter than itself."""
    rng = np.random.default_rng(seed)
    lengths = rng.integers(3, [20, 40, 70, 128][seed % 4], size=int(rng.integers(1, 9))).tolist()
    samples = samples_of_lengths(lengths)
    grid = ROW_GRIDS[ratio]
    config = PackingConfig(micro_batch_max_tokens=128, sequence_length=128, rows_bucket=1,
                           row_len_buckets=len(grid), row_len_ratio=ratio)
    assert config.row_lengths() == sorted(set(grid), reverse=True)
    cost = {row: len(reference_ffd(lengths, row)) * row for row in grid if row >= max(lengths)}
    best = min(cost, key=lambda row: (cost[row], -row))
    batch = config.pack(samples)
    assert batch.row_len == best, (lengths, cost)
    assert batch.num_micro_batches * batch.row_len == cost[best]
    if ratio < 2 and len(reference_ffd(lengths, 128)) == 1:
        # A batch that fits one row computes at most ~ratio × its tokens (+ the rounding),
        # or the shortest row.
        assert cost[best] <= max(min(grid), ratio * sum(lengths) + 16)
    kept = [batch.tokens[r][batch.segment_ids[r] == k + 1]
            for r in range(batch.num_micro_batches) for k in range(batch.sample_index.shape[1])
            if batch.sample_index[r, k] >= 0]
    assert sorted(map(len, kept)) == sorted(lengths)  # nothing cut


@pytest.mark.parametrize("load,cap,expected", [
    (768, 2048, 1024), (1024, 2048, 1024), (1025, 2048, 2048), (0, 2048, 64), (65, 512, 128),
    (100, 64, 64), (200, 448, 256), (225, 448, 256), (257, 448, 448),
])
def test_loss_slots_bucket_table(load, cap, expected):
    """cap, cap/2, cap/4, … rounded up to multiples of 64 (hand-listed): 448 → 256 (224
    rounded up), 128 (112 rounded up), 64; the fewest that hold the load."""
    assert loss_slots_bucket(load, cap) == expected


def test_bucketed_rows_get_loss_slots_sized_to_their_fullest_row():
    """With row buckets, a batch whose fullest row holds 303 loss positions gets fewer than
    twice that many slots (the LM head runs at every slot), not the 2,048-slot cap that one
    fixed row shape keeps."""
    samples = []
    for k in range(3):
        mask = np.r_[np.zeros(300), np.ones(101)]  # 101 loss positions
        samples.append(Sample(tokens=np.arange(401) % 50 + 1, loss_mask=mask,
                              old_logprobs=-mask, advantages=mask, prompt_len=300,
                              traj_id=k))
    bucketed = PackingConfig(micro_batch_max_tokens=8192, sequence_length=2048,
                             loss_slots=2048, row_len_buckets=13, row_len_ratio=2 ** 0.25)
    batch = bucketed.pack(samples)
    assert 303 <= batch.loss_slots < 606
    assert (batch.loss_index() >= 0).sum() == 303
    fixed = PackingConfig(micro_batch_max_tokens=8192, sequence_length=2048, loss_slots=2048)
    assert fixed.pack(samples).loss_slots == 2048


@pytest.mark.parametrize("align", [1, 16, 128])
def test_sample_align_starts_every_sample_at_a_multiple(align):
    """Samples start at multiples of `sample_align` (the attention block, so the learner's
    key blocks are the sampler's), stay whole and inside their row, and rows are filled
    under the aligned footprints (first-fit on lengths rounded up to `align`)."""
    rng = np.random.default_rng(align)
    lengths = rng.integers(1, 300, 40).tolist()
    samples = samples_of_lengths(lengths)
    config = PackingConfig(micro_batch_max_tokens=512, sequence_length=300, sample_align=align)
    batch = config.pack(samples)
    placed = 0
    for r in range(batch.num_micro_batches):
        ids = batch.segment_ids[r]
        for seg in range(1, ids.max() + 1):
            where = np.nonzero(ids == seg)[0]
            assert where[0] % align == 0
            assert np.array_equal(where, np.arange(where[0], where[0] + len(where)))
            i = batch.sample_index[r, seg - 1]
            assert len(where) == lengths[i]
            np.testing.assert_array_equal(batch.tokens[r, where], samples[i].tokens)
            placed += 1
    assert placed == len(samples)
    rows = sorted(sorted(int(i) for i in batch.sample_index[r] if i >= 0)
                  for r in range(batch.num_micro_batches) if batch.segment_ids[r].any())
    assert rows == reference_ffd([-(-n // align) * align for n in lengths], 512)


def test_sample_align_lets_a_full_row_sample_fill_its_row():
    """A sample as long as the row (not a multiple of the alignment) still fits, alone."""
    config = PackingConfig(micro_batch_max_tokens=200, sequence_length=200, sample_align=128)
    batch = config.pack(samples_of_lengths([200, 50, 60]))
    starts = np.nonzero(np.diff(batch.segment_ids, prepend=0, axis=1) > 0)
    assert np.all(starts[1] % 128 == 0)
    row = int(np.nonzero(batch.sample_index[:, 0] == 0)[0][0])
    assert (batch.segment_ids[row] == 1).sum() == 200 and batch.segment_ids[row].max() == 1


def test_sample_align_must_be_positive():
    with pytest.raises(ValueError, match="^sample_align: must be >= 1"):
        PackingConfig(sample_align=0)


def brute_force_block_pairs(segment_ids: np.ndarray, block: int) -> int:
    """Block pairs (i ≥ j) of some row in which a token of a segment attends to a token of
    the same segment: for each segment, every pair of the blocks its tokens fall in (the
    last of its tokens in block i follows all of its tokens in block j ≤ i)."""
    pairs = set()
    for r, row in enumerate(segment_ids):
        for seg in set(row[row > 0].tolist()):
            blocks = set((np.nonzero(row == seg)[0] // block).tolist())
            pairs.update((r, i, j) for i in blocks for j in blocks if j <= i)
    return len(pairs)


def test_row_starts_hand_examples():
    # 350 then 300 tokens: the second would start in block 2 and end in block 5 (4 blocks,
    # 4·5/2 − 1 = 9 pairs); on the edge, 384, it spans 3 (6 pairs). 34 slots of slack.
    assert buckets.row_starts([350, 300], 1, 128, (1024,)) == [0, 384]
    # ... but not past the length the row is computed at (650 tight, limit 660).
    assert buckets.row_starts([350, 300], 1, 128, (660,)) == [0, 350]
    # 300 then 300: starting at 300 it spans blocks 2–4, as many as on the edge, and shares
    # block 2 with the first sample: moving it would cost a pair.
    assert buckets.row_starts([300, 300], 1, 128, (1024,)) == [0, 300]
    assert buckets.row_starts([350, 300], 1, 0, (1024,)) == [0, 350]  # off
    assert buckets.row_starts([350, 300], 128, 128, (1024,)) == [0, 384]  # forced
    assert buckets.row_starts([50, 60], 16, 128, (512,)) == [0, 64]  # 50 → 64 (align 16)
    # Pairs of the hand examples (the closed form against the count above).
    assert buckets.block_pairs([0, 350], [350, 300], 128) == 6 + 10 - 1
    assert buckets.block_pairs([0, 384], [350, 300], 128) == 6 + 6


@pytest.mark.parametrize("seed", range(6))
def test_align_when_free_keeps_rows_and_slots_and_never_adds_block_pairs(seed):
    """Against the tight layout of the same samples: the same rows, every sample whole at
    its place, no row's end past the prefix it was computed at (so no slot more), and
    never more attention block pairs (brute force over token pairs); fewer in total."""
    rng = np.random.default_rng(seed)
    lengths = rng.integers(20, 700, 24).tolist()
    samples = samples_of_lengths(lengths)
    kwargs = dict(micro_batch_max_tokens=2048, sequence_length=1024, rows_bucket=1)
    tight = PackingConfig(**kwargs, align_when_free=False).pack(samples)
    free = PackingConfig(**kwargs).pack(samples)
    np.testing.assert_array_equal(free.sample_index, tight.sample_index)
    limits = np.asarray(buckets.prefix_lengths(2048, PackingConfig().row_prefixes))
    for r in range(tight.num_micro_batches):
        used = [np.nonzero(b.segment_ids[r])[0].max(initial=-1) + 1 for b in (tight, free)]
        assert used[1] <= limits[np.searchsorted(limits, used[0])]
        for seg in range(1, free.segment_ids[r].max() + 1):
            where = np.nonzero(free.segment_ids[r] == seg)[0]
            i = free.sample_index[r, seg - 1]
            np.testing.assert_array_equal(free.tokens[r, where], samples[i].tokens)
            np.testing.assert_array_equal(free.positions[r, where], np.arange(lengths[i]))
        row_pairs = [brute_force_block_pairs(b.segment_ids[r:r + 1], 128) for b in (tight, free)]
        assert row_pairs[1] <= row_pairs[0]
    assert (brute_force_block_pairs(free.segment_ids, 128)
            < brute_force_block_pairs(tight.segment_ids, 128))
