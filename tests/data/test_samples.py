"""Sample formation: gen-only step samples, exact advantage placement, prefix merge."""

import numpy as np
import pytest

from jaxrl_agentic.data import pack_samples
from jaxrl_agentic.data.samples import (
    build_samples,
    merge_prefix_samples,
    step_samples,
    trajectory_sample,
)
from jaxrl_agentic.data.trajectory import Trajectory, Turn

EOS = 99


def make_traj(turns, traj_id=0, prompt=(1, 2, 3), obs=(7, 8)):
    """turns: list of (generated ids, eos_appended). Observation `obs` between turns."""
    tokens = list(prompt)
    records = []
    for t, (gen, eos_appended) in enumerate(turns):
        if t:
            tokens += list(obs)
        ctx = len(tokens)
        tokens += list(gen)
        if eos_appended:
            tokens.append(EOS)
        records.append(Turn(context_len=ctx, generated=list(gen),
                            logprobs=-np.arange(1, len(gen) + 1, dtype=np.float32) / 10,
                            stop_reason="length" if eos_appended else "eos",
                            eos_appended=eos_appended, reward=float(t), action=0,
                            action_is_valid=True, action_is_effective=True, success=False,
                            done=False, state_hash=bytes([t])))
    return Trajectory(traj_id=traj_id, group_id=0, tag="t", seed=0, tokens=tokens, turns=records)


def test_code_appended_eos_and_observations_have_mask_zero():
    traj = make_traj([([10, 11], True), ([12, 13, EOS], False), ([14], True)])
    sample = trajectory_sample(traj, 1.0)
    generated = {i for u in traj.turns
                 for i in range(u.context_len, u.context_len + len(u.generated))}
    for i in range(len(sample.tokens)):
        assert sample.loss_mask[i] == (1.0 if i in generated else 0.0), i
    # the appended EOS after turn 0 sits at context_len + 2 and is not trained on
    assert sample.tokens[traj.turns[0].context_len + 2] == EOS
    assert sample.loss_mask[traj.turns[0].context_len + 2] == 0
    # a model-generated EOS is trained on
    assert sample.loss_mask[traj.turns[1].context_len + 2] == 1
    assert sample.loss_mask.sum() == 6


def test_step_samples_are_gen_only_and_bounded():
    traj = make_traj([([10, 11], True), ([12, 13, 14], True), ([15], True)], obs=(7, 8, 9, 6))
    for turn, s in zip(traj.turns, step_samples(traj, [1, 2, 3]), strict=True):
        assert list(s.tokens[s.prompt_len:]) == turn.generated  # no observation in response
        assert s.prompt_len == turn.context_len
        np.testing.assert_array_equal(s.old_logprobs[s.prompt_len:], turn.logprobs)


def test_stepwise_advantage_lands_on_each_steps_own_tokens():
    """Regression: a peer copied the last step's masked row to every step; with
    right-aligned, variable-length steps the earlier steps then trained on zeros."""
    traj = make_traj([([10, 11, 12, 13, 14], True), ([15], True), ([16, 17, 18], True)])
    samples = step_samples(traj, 0.75)
    for s in samples:
        resp = slice(s.prompt_len, len(s.tokens))
        np.testing.assert_array_equal(s.advantages[resp], 0.75)  # earlier steps are not zero
        assert (s.advantages[: s.prompt_len] == 0).all()
    # ... and after packing, every segment's loss tokens carry exactly the advantage
    batch = pack_samples(samples, micro_batch_max_tokens=64, sequence_length=64)
    loss = batch.loss_mask > 0
    assert loss.sum() == 9
    np.testing.assert_array_equal(batch.advantages[loss], 0.75)
    # The buggy broadcast (right-aligned rows, last step's masked row copied) fails this:
    width = max(len(s.tokens) for s in samples)
    right_masks = np.stack([np.pad(s.loss_mask, (width - len(s.tokens), 0)) for s in samples])
    buggy = np.tile(right_masks[-1] * 0.75, (len(samples), 1))
    assert not all((buggy[i][right_masks[i] > 0] == 0.75).all() for i in range(len(samples)))


def _merged_equals_unmerged(merged, unmerged):
    """Every token keeps the mask/logprob/advantage it had in its own step sample."""
    for s in unmerged:
        m = next(x for x in merged if len(x.tokens) >= len(s.tokens)
                 and np.array_equal(x.tokens[: len(s.tokens)], s.tokens)
                 and x.prompt_len <= s.prompt_len)
        resp = slice(s.prompt_len, len(s.tokens))
        np.testing.assert_array_equal(m.loss_mask[resp], s.loss_mask[resp])
        np.testing.assert_array_equal(m.old_logprobs[resp], s.old_logprobs[resp])
        np.testing.assert_array_equal(m.advantages[resp], s.advantages[resp])
    total = sum(s.loss_mask.sum() for s in unmerged)
    assert sum(m.loss_mask.sum() for m in merged) == total


def test_merge_exact_prefix_three_turns_into_one():
    traj = make_traj([([10, 11], False), ([12], False), ([13, 14], False)])
    steps = step_samples(traj, [0.5, -1.0, 2.0])
    merged = merge_prefix_samples(steps)
    assert len(merged) == 1
    assert list(merged[0].tokens) == traj.tokens[: traj.turns[-1].context_len + 2]
    # observation delta between turns is not trained on
    obs_pos = range(traj.turns[0].context_len + 2, traj.turns[1].context_len)
    assert all(merged[0].loss_mask[i] == 0 for i in obs_pos)
    _merged_equals_unmerged(merged, steps)


def test_merge_mismatch_and_partial_merge():
    a = make_traj([([10, 11], False), ([12], False)])
    b = make_traj([([20], False), ([21], False)], prompt=(1, 2, 3))
    steps = step_samples(a, [1, 1]) + step_samples(b, [2, 2])
    # 4 turns of 2 trajectories → 2 sequences (traj ids differ even though prompts match)
    b_steps = step_samples(b, [2, 2])
    for s in b_steps:
        s.traj_id = 1
    merged = merge_prefix_samples(step_samples(a, [1, 1]) + b_steps)
    assert len(merged) == 2
    _merged_equals_unmerged(merged, step_samples(a, [1, 1]) + b_steps)
    # mismatch inside one trajectory: a rewritten history cannot merge
    s0, s1 = step_samples(a, [1, 1])
    s1.tokens = s1.tokens.copy()
    s1.tokens[1] = 55
    assert len(merge_prefix_samples([s0, s1])) == 2
    del steps


def test_merge_requires_prefix_of_next_prompt_not_of_next_response():
    s0, s1 = step_samples(make_traj([([10, 11], False), ([12], False)], obs=()), [1, 1])
    # s0's tokens are a prefix of s1's prompt here (obs empty): merges
    assert len(merge_prefix_samples([s0, s1])) == 1
    # If s0's response ran into s1's *response* (not its prompt), it must not merge.
    s1_short = step_samples(make_traj([([10, 11], False), ([12], False)], obs=()), [1, 1])[1]
    s1_short.prompt_len = len(s0.tokens) - 1
    s1_short.loss_mask = s1_short.loss_mask.copy()
    s1_short.loss_mask[s1_short.prompt_len:] = 1
    assert len(merge_prefix_samples([s0, s1_short])) == 2


def test_build_samples_modes_and_stats():
    single = make_traj([([10], False)], traj_id=0)
    multi = make_traj([([10, 11], True), ([12], True), ([13], True)], traj_id=1)
    trajs = [single, multi]
    advs = [np.array([1.0]), np.array([2.0, 3.0, 4.0])]
    samples, stats = build_samples(trajs, advs, sample_mode="step", merge_stepwise=True)
    assert stats["batch/sequences_before_merge"] == 4
    assert stats["batch/sequences_after_merge"] == 2
    samples, _ = build_samples(trajs, advs, sample_mode="trajectory")
    assert len(samples) == 2
    with pytest.raises(ValueError, match="sample_mode"):
        build_samples(trajs, advs, sample_mode="turn")
    with pytest.raises(ValueError, match="merge_stepwise"):
        build_samples(trajs, advs, sample_mode="trajectory", merge_stepwise=True)


def test_misaligned_advantages_raise_one_line_errors():
    """A length-1 advantage array for a 3-turn episode is misaligned data, not a scalar:
    it used to be broadcast over every turn (np.broadcast_to) or token (× mask)."""
    traj = make_traj([([10, 11], True), ([12], True), ([14], True)], traj_id=5)
    for bad in (np.array([0.5]), np.array([0.5, 1.0])):
        with pytest.raises(ValueError, match=r"^trajectory 5: \(\d,\) advantages for 3 turns"):
            trajectory_sample(traj, bad)
        with pytest.raises(ValueError, match="advantages for 3 turns"):
            step_samples(traj, bad)
        with pytest.raises(ValueError, match="advantages for 3 turns"):
            build_samples([traj], [bad], sample_mode="trajectory")
    with pytest.raises(ValueError, match="per-token advantages for a sample of"):
        trajectory_sample(traj, np.array([0.5]), token_level=True)
    # A 0-d scalar is the documented "same value on every turn".
    sample = trajectory_sample(traj, 0.5)
    assert set(sample.advantages[sample.loss_mask > 0]) == {0.5}


def test_samples_carry_the_versions_of_their_own_tokens():
    """Each sample's (min_version, max_version) is over the tokens it trains on: per turn
    for step samples, over the episode for a trajectory sample, combined by a merge; a
    turn without recorded versions is stamped by `stamp_versions`."""
    from jaxrl_agentic.data.trajectory import stamp_versions

    traj = make_traj([([10, 11], False), ([12, 13], False), ([14], False)])
    for turn, versions in zip(traj.turns, ([3, 3], [3, 4], None), strict=True):
        turn.versions = None if versions is None else np.asarray(versions, np.int32)
    stamp_versions([traj], 5)  # fills the third turn only
    assert traj.token_versions().tolist() == [3, 3, 3, 4, 5]
    steps = step_samples(traj, [0.0, 0.0, 0.0])
    assert [(s.min_version, s.max_version) for s in steps] == [(3, 3), (3, 4), (5, 5)]
    whole = trajectory_sample(traj, 1.0)
    assert (whole.min_version, whole.max_version) == (3, 5)
    merged = merge_prefix_samples(steps[1:])
    assert len(merged) == 1 and (merged[0].min_version, merged[0].max_version) == (3, 5)
