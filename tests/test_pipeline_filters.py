"""DAPO's filters and the collapse diagnostics as the pipeline applies them, on hand-built
trajectories (the Pipeline methods run against a stand-in `self` with only what they read)."""

import dataclasses
import types

import ml_collections
import numpy as np

from jaxrl_agentic.config import default_config, env_manager, env_spec
from jaxrl_agentic.data.samples import step_samples, trajectory_sample
from jaxrl_agentic.data.trajectory import Trajectory, Turn
from jaxrl_agentic.pipeline import Pipeline
from jaxrl_agentic.run_config import build_run_config


def turn(context_len, n, reward=0.0, stop="eos"):
    return Turn(context_len=context_len, generated=list(range(1, n + 1)),
                logprobs=np.full(n, -0.5, np.float32), stop_reason=stop, eos_appended=False,
                reward=reward, action=0, action_is_valid=True, action_is_effective=True,
                success=False, done=False, state_hash=b"")


def episode(traj_id, group_id, rewards, stops=None, prompt=3, gen=2, tag="fl",
            truncated_by_length=False):
    """Turns of `gen` tokens after prompts of `prompt` tokens, one turn per reward."""
    stops = stops or ["eos"] * len(rewards)
    turns, length = [], 0
    for r, stop in zip(rewards, stops, strict=True):
        turns.append(turn(length + prompt, gen, r, stop))
        length += prompt + gen
    return Trajectory(traj_id=traj_id, group_id=group_id, tag=tag, seed=0,
                      tokens=list(range(length)), turns=turns,
                      truncated_by_length=truncated_by_length)


def stand_in(**fields):
    c = default_config()
    c.update(dict(sequence_length=1000, max_input_length=900, overlong_penalty_length=0,
                  overlong_penalty=1.0, dynamic_sampling_max_rounds=3,
                  custom_envs=ml_collections.ConfigDict(
                      {"fl": env_spec("frozen_lake", max_tokens_per_step=8)}),
                  train_env_manager=env_manager(2, 2, tags=("fl",)),
                  val_env_manager=env_manager(2, 1, tags=("fl",)),
                  adv_estimator="grpo", reward_norm_by="group", norm_adv_std=True,
                  step_reward_gamma=0.5, gigpo_step_weight=1.0, gamma=1.0, lambd=0.95))
    c.update(fields)
    me = types.SimpleNamespace(config=build_run_config(c), sequence_length=c.sequence_length)
    me.turn_advantages = lambda trajs: Pipeline.turn_advantages(me, trajs)
    me.informative = lambda trajs: Pipeline.informative(me, trajs)
    return me


def test_overlong_filter_masks_samples_whose_last_reply_was_cut():
    trajs = [
        episode(0, 0, [0, 1]),                                 # finished: kept
        episode(1, 0, [0, 1], stops=["length", "eos"]),        # a middle reply cut: kept
        episode(2, 0, [0, 1], stops=["eos", "length"]),        # the last reply cut
        episode(3, 0, [0, 1], truncated_by_length=True),       # ended by the prompt limit
        episode(4, 0, [0, 1, 0, 1], prompt=4),                 # 24 tokens > sequence_length
    ]
    samples = [trajectory_sample(t, 1.0) for t in trajs]
    me = stand_in(sequence_length=20)
    kept, filtered = Pipeline.filter_overlong(me, trajs, samples)
    assert filtered == 3
    assert [s.traj_id for s in kept] == [0, 1]
    np.testing.assert_array_equal(kept[1].loss_mask, samples[1].loss_mask)
    # Step samples: each ends at its own turn, judged by that turn's stop reason.
    steps = step_samples(trajs[2], [1.0, 1.0])
    kept, filtered = Pipeline.filter_overlong(me, [trajs[2]], steps)
    assert filtered == 1 and [s.turn for s in kept] == [0]


def test_overlong_penalty_is_added_to_the_reward_of_long_replies():
    # Budget 8, window 4, P = 0.5: lengths 4, 6, 8 → 0, −0.25, −0.5 (DAPO eq. 13).
    me = stand_in(overlong_penalty_length=4, overlong_penalty=0.5)
    trajs = [episode(0, 0, [1.0], gen=4), episode(1, 0, [1.0], gen=6),
             episode(2, 0, [1.0], gen=8)]
    me.overlong_penalties = lambda t: Pipeline.overlong_penalties(me, t)
    Pipeline.shape_rewards(me, trajs)
    assert [t.turns[0].reward for t in trajs] == [1.0, 0.75, 0.5]
    metrics = Pipeline.overlong_penalty_metrics(me, trajs)
    assert np.isclose(metrics["batch/overlong_penalty_mean"], -0.25)


def test_dynamic_sampling_plays_rounds_until_the_groups_carry_signal():
    # Round 0: group 0 all 1 (no signal), group 1 mixed. Round 1: group 2 mixed, group 3
    # all 0. Two informative groups are needed, so round 1 is played and groups 1, 2 kept.
    rounds = {1: [episode(4, 2, [1.0]), episode(5, 2, [0.0]),
                  episode(6, 3, [0.0]), episode(7, 3, [0.0])]}
    calls = []

    def rollout(split, *, cursor, round_index):
        calls.append((split, cursor, round_index))
        return rounds[round_index]

    me = stand_in()
    me.train_manager = types.SimpleNamespace(num_env_groups=2)
    me.cursor = 10
    me.rollout = rollout
    me.shape_rewards = lambda trajs: {}
    first = [episode(0, 0, [1.0]), episode(1, 0, [1.0]), episode(2, 1, [0.0]),
             episode(3, 1, [1.0])]
    kept, played, n = Pipeline.fill_informative_groups(me, first)
    assert calls == [("train", 12, 1)]  # the next two groups' seeds
    assert n == 2 and len(played) == 8
    assert [t.traj_id for t in kept] == [2, 3, 4, 5]
    # Rounds run out: train on what carries signal.
    me.config = dataclasses.replace(me.config, rollout=dataclasses.replace(
        me.config.rollout, dynamic_sampling_max_rounds=1))
    kept, played, n = Pipeline.fill_informative_groups(me, first)
    assert n == 1 and [t.traj_id for t in kept] == [2, 3]


def test_dynamic_sampling_keeps_equal_score_groups_whose_turns_carry_signal():
    # Turn rewards [1, 0] and [0, 1]: equal episode scores (1 and 1), but turn_grpo's
    # per-turn advantages are non-zero ([[.78, −1.31], [−.26, .78]] at γ = 0.5), so the
    # group carries signal and must be kept; a group of [0, 0] twice carries none.
    trajs = [episode(0, 0, [1.0, 0.0]), episode(1, 0, [0.0, 1.0]),
             episode(2, 1, [0.0, 0.0]), episode(3, 1, [0.0, 0.0])]
    for t in trajs:  # the state before turn k is the same in every episode (GiGPO's anchors)
        for k, u in enumerate(t.turns):
            u.state_hash = bytes([k])
    for estimator in ("turn_grpo", "gigpo"):
        me = stand_in(adv_estimator=estimator)
        assert [t.traj_id for t in me.informative(trajs)] == [0, 1], estimator
        advantages = me.turn_advantages(trajs[:2])
        assert max(np.abs(a).max() for a in advantages) > 0.2
    # grpo on the same episodes: equal scores in both groups, no signal anywhere.
    assert stand_in(adv_estimator="grpo").informative(trajs) == []
    # A batch baseline (reward_norm_by="batch") judges groups against the whole batch.
    batch = [episode(0, 0, [1.0]), episode(1, 0, [1.0]), episode(2, 1, [0.0]),
             episode(3, 1, [0.0])]
    me = stand_in(adv_estimator="grpo", reward_norm_by="batch")
    assert [t.traj_id for t in me.informative(batch)] == [0, 1, 2, 3]


def test_no_informative_group_under_token_estimators_means_no_samples():
    # reinforce_plus_plus / gae decide by the episode scores (DAPO's rule); a round that
    # keeps nothing must give an empty batch (no update), not a crash.
    from jaxrl_agentic.algos.estimators import token_advantages
    from jaxrl_agentic.pipeline import token_estimator_samples

    trajs = [episode(0, 0, [1.0]), episode(1, 0, [1.0])]
    for estimator in ("reinforce_plus_plus", "gae"):
        me = stand_in(adv_estimator=estimator, dynamic_sampling_max_rounds=1)
        me.train_manager = types.SimpleNamespace(num_env_groups=1)
        kept, _, rounds = Pipeline.fill_informative_groups(me, trajs)
        assert kept == [] and rounds == 1
        samples, stats = token_estimator_samples(kept, adv_estimator=estimator)
        assert samples == [] and stats["batch/sequences_after_merge"] == 0.0
        assert token_advantages([], adv_estimator=estimator)[0] == []


def test_collapse_metrics_of_a_batch():
    # Group 0: scores 1, 1 and the same replies; group 1: scores 0, 1 and different replies.
    trajs = [episode(0, 0, [1.0]), episode(1, 0, [1.0]), episode(2, 1, [0.0]),
             episode(3, 1, [1.0], gen=3)]
    m = Pipeline.collapse_metrics(None, trajs)
    assert m["batch/zero_variance_groups"] == 0.5
    assert np.isclose(m["batch/group_reward_std"], (0.0 + 0.5) / 2)
    assert m["batch/distinct_replies_per_group"] == 1.5
