"""Tree packing: the layout written out by hand, every sample recoverable from its row, groups
cut to fit a row, and the mini-batch split that keeps groups together."""

import numpy as np
import pytest

from jaxrl_agentic.data import PackingConfig, Sample, split_minibatches
from jaxrl_agentic.data.packing import pack_samples, pack_tree, token_stats
from jaxrl_agentic.data.tree_packing import prefix_groups, prompt_groups


def sample(tokens, prompt_len, traj_id=0, seed=0):
    tokens = np.asarray(tokens)
    mask = np.zeros(len(tokens))
    mask[prompt_len:] = 1
    rng = np.random.default_rng(seed)
    return Sample(tokens=tokens, loss_mask=mask, old_logprobs=-mask * rng.uniform(1, 2, len(mask)),
                  advantages=mask * rng.normal(), traj_id=traj_id, prompt_len=prompt_len)


def test_layout_of_one_group_written_out():
    """Prompt [5 6 7 8] shared by two members: [5 6 7] once (positions 0-2), then each
    member from the prompt's last token on, at its own positions, reading segment 1."""
    a = sample([5, 6, 7, 8, 10, 11], 4, traj_id=0)
    b = sample([5, 6, 7, 8, 20, 21, 22], 4, traj_id=1)
    batch = pack_tree([a, b], micro_batch_max_tokens=16, sequence_length=16)
    np.testing.assert_array_equal(batch.tokens[0, :10], [5, 6, 7, 8, 10, 11, 8, 20, 21, 22])
    np.testing.assert_array_equal(batch.positions[0, :10], [0, 1, 2, 3, 4, 5, 3, 4, 5, 6])
    np.testing.assert_array_equal(batch.segment_ids[0, :11], [1] * 3 + [2] * 3 + [3] * 4 + [0])
    np.testing.assert_array_equal(batch.prefix_ids[0, :11], [0] * 3 + [1] * 7 + [0])
    np.testing.assert_array_equal(batch.loss_mask[0, :10], [0, 0, 0, 0, 1, 1, 0, 1, 1, 1])
    np.testing.assert_array_equal(batch.sample_index[0, :3], [-1, 0, 1])
    np.testing.assert_array_equal(batch.seg_offset[0, :3], [0, 3, 3])
    assert batch.shared_saved == 3
    stats = token_stats(batch)
    assert stats["real_tokens"] + stats["shared_saved"] == len(a) + len(b)
    assert "prefix_ids" in batch.token_arrays()


def _random_groups(rng, groups, members, prompt=(3, 40), reply=(1, 30)):
    samples = []
    for g in range(groups):
        p = int(rng.integers(*prompt))
        head = rng.integers(1, 50, p)
        for m in range(members):
            tail = rng.integers(1, 50, int(rng.integers(*reply)))
            samples.append(sample(np.concatenate([head, tail]), p, traj_id=g * 10 + m, seed=m))
    order = rng.permutation(len(samples))
    return [samples[i] for i in order]


def _recovered(batch, n):
    """Each sample's tokens and per-token floats read back from the rows: its prefix
    segment's tokens, then its own segment's."""
    out = [None] * n
    for r, col in zip(*np.nonzero(batch.sample_index >= 0), strict=True):
        sid = col + 1
        own = batch.segment_ids[r] == sid
        parents = set(batch.prefix_ids[r][own])
        assert len(parents) == 1
        parent = parents.pop()
        head = batch.segment_ids[r] == parent if parent else np.zeros_like(own)
        assert int(batch.seg_offset[r, col]) == head.sum()
        fields = {name: np.concatenate([getattr(batch, name)[r][head],
                                        getattr(batch, name)[r][own]])
                  for name in ("tokens", "positions", "loss_mask", "advantages")}
        out[batch.sample_index[r, col]] = fields
    return out


@pytest.mark.parametrize("row", [128, 512])
def test_every_sample_is_recovered_whole_and_groups_that_do_not_fit_are_cut(row):
    rng = np.random.default_rng(0)
    samples = _random_groups(rng, groups=5, members=4) + [sample(rng.integers(1, 50, 9), 1)]
    batch = pack_tree(samples, micro_batch_max_tokens=row, sequence_length=row)
    back = _recovered(batch, len(samples))
    for s, got in zip(samples, back, strict=True):
        np.testing.assert_array_equal(got["tokens"], s.tokens)
        np.testing.assert_array_equal(got["positions"], np.arange(len(s)))
        np.testing.assert_array_equal(got["loss_mask"], s.loss_mask)
        np.testing.assert_array_equal(got["advantages"], s.advantages)
    # Tokens: the flat layout's minus what was shared; no prefix segment holds a loss token.
    flat = pack_samples(samples, micro_batch_max_tokens=row, sequence_length=row)
    assert (batch.segment_ids > 0).sum() == (flat.segment_ids > 0).sum() - batch.shared_saved
    assert batch.shared_saved > 0
    prefix_segments = batch.sample_index < 0
    for r, col in zip(*np.nonzero(prefix_segments & (batch.seg_prompt_len > 0)), strict=True):
        assert batch.loss_mask[r][batch.segment_ids[r] == col + 1].sum() == 0


def test_a_group_larger_than_a_row_gets_a_prefix_copy_per_row():
    head = list(range(1, 41))  # a 40-token prompt, 3 members of 60 tokens: 40 + 3·21 > 96
    samples = [sample(head + [50 + m] * 20, 40, traj_id=m) for m in range(3)]
    batch = pack_tree(samples, micro_batch_max_tokens=96, sequence_length=96)
    assert batch.num_micro_batches == 2
    # Row 0: prefix (39) + 2 members (21 each); row 1: the third alone, placed flat (60).
    assert batch.shared_saved == 39
    assert sorted(batch.sample_index[batch.sample_index >= 0].tolist()) == [0, 1, 2]
    assert (batch.prefix_ids[1] == 0).all()


def test_singletons_and_one_token_prompts_are_packed_flat():
    a, b = sample([1, 2, 3], 1), sample([1, 4, 5], 1)  # prompt_len 1: nothing to share
    c = sample([7, 8, 9, 10], 2)
    batch = pack_tree([a, b, c], micro_batch_max_tokens=16, sequence_length=16)
    assert batch.shared_saved == 0 and not batch.prefix_ids.any()
    assert prefix_groups([a, b, c]) == [([0], 0), ([1], 0), ([2], 0)]


def test_groups_share_the_longest_start_that_saves_most():
    """Step samples: a group's turns all begin with its first prompt (6 tokens), later turns
    add their own history; two groups begin with the same 3 instruction tokens. Each group
    shares its first prompt, not the instructions across groups."""
    first = {0: [1, 2, 3, 10, 11, 12], 1: [1, 2, 3, 20, 21, 22]}
    samples = []
    for g in (0, 1):
        samples.append(sample(first[g] + [40, 41], 6, traj_id=g))  # turn 0
        samples.append(sample(first[g] + [40, 41, 50, 51, 52], 9, traj_id=g))  # turn 1
        samples.append(sample(first[g] + [42, 43, 53, 54, 55], 9, traj_id=g))  # turn 1
    groups = prefix_groups(samples)
    assert [(sorted(m), s) for m, s in groups] == [([0, 1, 2], 5), ([3, 4, 5], 5)]
    batch = pack_tree(samples, micro_batch_max_tokens=64, sequence_length=64)
    assert batch.shared_saved == 2 * 2 * 5
    back = _recovered(batch, len(samples))
    for s, got in zip(samples, back, strict=True):
        np.testing.assert_array_equal(got["tokens"], s.tokens)


def test_packing_config_tree_and_keys():
    samples = _random_groups(np.random.default_rng(1), groups=3, members=4)
    tree = PackingConfig(micro_batch_max_tokens=256, sequence_length=256, rows_bucket=0,
                         fixed_rows=False, share_group_prefix=True)
    batch = tree.pack(samples)
    assert batch.shared_saved > 0 and batch.prefix_ids is not None
    assert tree.batch_keys(("tokens",)) == ("tokens", "prefix_ids") and tree.keeps_groups
    flat = PackingConfig(micro_batch_max_tokens=256, sequence_length=256)
    assert flat.batch_keys(("tokens",)) == ("tokens",) and not flat.keeps_groups
    assert flat.pack(samples).prefix_ids is None


def test_split_keeps_groups_together_and_every_sample_once_per_epoch():
    samples = _random_groups(np.random.default_rng(2), groups=6, members=4)
    batches = split_minibatches(samples, 8, 2, np.random.default_rng(0), keep_groups=True)
    assert len(batches) == 2 * 3
    for epoch in (batches[:3], batches[3:]):
        seen = [id(s) for mb in epoch for s in mb]
        assert sorted(seen) == sorted(id(s) for s in samples)
        for mb in epoch:  # 8 = two whole groups of 4: each mini-batch holds two prompts
            assert sorted(len(g) for g, _ in prefix_groups(mb)) == [4, 4]


def _groups_after_shared_instructions(groups, members, system=30):
    """GRPO-like samples, given group after group: every prompt is the same ``system``-token
    instructions, then the group's own 5-token question, then the same 2-token turn header
    (``traj_id // 10`` is the group); each member its own reply."""
    rng = np.random.default_rng(7)
    instructions, header = rng.integers(1, 50, system), [60, 61]
    samples = []
    for g in range(groups):
        prompt = np.concatenate([instructions, rng.integers(1, 50, 5), header])
        for m in range(members):
            reply = rng.integers(1, 50, int(rng.integers(2, 9)))
            samples.append(sample(np.concatenate([prompt, reply]), len(prompt),
                                  traj_id=10 * g + m, seed=m))
    return samples


def _epochs(batches, per_epoch):
    """Each epoch's mini-batches as tuples of the GRPO groups they hold, in order."""
    return [tuple(tuple(sorted({s.traj_id // 10 for s in mb})) for mb in batches[e:e + per_epoch])
            for e in range(0, len(batches), per_epoch)]


def test_groups_that_share_only_their_instructions_stay_apart_and_are_shuffled():
    """Six groups of four share a 30-token instruction block, more than each group's own
    question: the shuffle still sees six groups, and mini-batches of 8 hold two whole
    groups, drawn anew each epoch and with each seed, and are tree-packed exactly."""
    samples = _groups_after_shared_instructions(groups=6, members=4)
    six = [[10 * g + m for m in range(4)] for g in range(6)]
    assert sorted(sorted(samples[i].traj_id for i in g) for g in prompt_groups(samples)) == six
    # Packed apart, each group saves 3·36 tokens; chained as one, 23·30 < 6·3·36.
    groups = prefix_groups(samples)
    assert sorted(sorted(samples[i].traj_id for i in m) for m, _ in groups) == six
    assert {shared for _, shared in groups} == {36}
    # One sample per map shares nothing else: the instructions are shared (23·30 tokens).
    alone = _groups_after_shared_instructions(groups=24, members=1)
    assert [len(m) for m, _ in prefix_groups(alone)] == [24]
    assert prefix_groups(alone)[0][1] == 30
    epochs = []
    for seed in range(3):
        batches = split_minibatches(samples, 8, 3, np.random.default_rng(seed), keep_groups=True)
        for mb in batches:  # two whole groups of four
            assert len(mb) == 8 and len({s.traj_id // 10 for s in mb}) == 2
        epochs += _epochs(batches, 3)
        batch = pack_tree(batches[0], micro_batch_max_tokens=512, sequence_length=512)
        assert batch.shared_saved >= 2 * 3 * 36  # at least each group's prompt, once
        for s, got in zip(batches[0], _recovered(batch, 8), strict=True):
            np.testing.assert_array_equal(got["tokens"], s.tokens)
            np.testing.assert_array_equal(got["positions"], np.arange(len(s)))
    assert len(set(epochs)) > len(epochs) // 2  # 9 epochs, drawn from 6!/(2!^3) orders


def test_pairs_after_shared_instructions_are_not_the_same_mini_batches_every_epoch():
    """Group size 2, one group per mini-batch: chained into one group, every epoch and seed
    gave the groups in their sorted order, [[0, 1], [2, 3], …]."""
    samples = _groups_after_shared_instructions(groups=8, members=2)
    epochs = []
    for seed in range(3):
        batches = split_minibatches(samples, 2, 2, np.random.default_rng(seed), keep_groups=True)
        assert all(len({s.traj_id // 10 for s in mb}) == 1 for mb in batches)
        epochs += _epochs(batches, 8)
    assert len(set(epochs)) == len(epochs)  # 6 epochs of 8! orders: all different
