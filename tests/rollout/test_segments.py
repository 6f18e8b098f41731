"""Episodes longer than the context (rollout/segments.py) with the real sampler and the tiny
model: under "full" they end truncated by length; under "window:k" they continue as new
samples whose loss masks hold every generated token once, in both schedules."""

import jax
import numpy as np
import pytest

from jaxrl_agentic.algos.estimators import turn_advantages
from jaxrl_agentic.data.samples import build_samples
from jaxrl_agentic.data.trajectory import Trajectory, Turn, episode_segments, joined_episode
from jaxrl_agentic.envs import make
from jaxrl_agentic.envs.messages import first_message
from jaxrl_agentic.envs.python_env import PyStep, PythonTextEnv, text_state_hash
from jaxrl_agentic.models import load_pretrained
from jaxrl_agentic.pipeline.metrics import trajectory_metrics
from jaxrl_agentic.rollout.conversation import ChatFormatter
from jaxrl_agentic.rollout.groups import EnvManagerConfig, plan_episodes
from jaxrl_agentic.rollout.history import parse_history
from jaxrl_agentic.rollout.loop import RolloutRunner, replay_frames
from jaxrl_agentic.rollout.python_runner import PythonRolloutRunner
from jaxrl_agentic.rollout.turns import GenerationConfig
from jaxrl_agentic.sampling import Sampler

MAX_NEW = 8
MAX_TURNS = 8


@pytest.fixture(scope="module")
def setup(tiny_model_dir):
    model, tok = load_pretrained(tiny_model_dir)
    formatter = ChatFormatter(tok)
    env, params = make("frozen_lake")
    _, state = env.reset(jax.random.PRNGKey(0), params)
    first_len = len(formatter.first_prompt(first_message(env, state, params)))
    # Room for about three turns: every episode that lives longer outgrows the context.
    max_input_length = first_len + 3 * 32
    sampler = Sampler(model, tok, max_total_len=max_input_length + MAX_NEW + 1)
    manager = EnvManagerConfig(num_env_groups=2, group_size=2, tags=("lake",))
    episodes = plan_episodes(manager, split="train", cursor=5)["lake"]
    return env, params, sampler, formatter, max_input_length, episodes


def play(setup, history="full", **kwargs):
    env, params, sampler, formatter, max_input_length, episodes = setup
    runner = RolloutRunner(env, params, sampler, formatter, tag="lake", max_turns=MAX_TURNS,
                           max_input_length=max_input_length, history=parse_history(history),
                           generation=GenerationConfig(max_tokens_per_step=MAX_NEW), **kwargs)
    return runner.run(episodes, sample_seed=0)


@pytest.fixture(scope="module")
def full(setup):
    return play(setup, "full")


@pytest.fixture(scope="module")
def windowed(setup):
    return play(setup, "window:1")


def by_episode(trajs):
    return [[trajs[i] for i in e] for e in episode_segments(trajs)]


def test_full_history_ends_long_episodes_and_a_window_continues_them(setup, full, windowed):
    max_input_length = setup[4]
    assert all(t.segment == 0 for t in full)
    cut = [t for t in full if t.truncated_by_length]
    assert cut, "the limit must be hit mid-episode under full history"
    episodes = by_episode(windowed)
    assert len(episodes) == len(full)
    split = [e for e in episodes if len(e) > 1]
    assert split and max(len(e) for e in split) >= 3  # rewritten more than once
    for segs, whole in zip(episodes, full, strict=True):
        first = segs[0]
        assert (first.traj_id, first.group_id, first.member) == (
            whole.traj_id, whole.group_id, whole.member)
        assert [t.segment for t in segs] == list(range(len(segs)))
        assert len({(t.tag, t.group_id, t.member, t.seed) for t in segs}) == 1
        assert len({t.traj_id for t in segs}) == len(segs)
        # Until its first rewrite the episode is the one "full" played, token for token.
        n = min(len(first.tokens), len(whole.tokens))
        assert first.tokens[:n] == whole.tokens[:n]
        for seg in segs[:-1]:  # an earlier segment neither ended nor was cut
            assert not (seg.terminated or seg.truncated or seg.truncated_by_length)
            assert not seg.turns[-1].done
        for seg in segs:
            assert all(u.context_len <= max_input_length for u in seg.turns)
        played = sum(len(t.turns) for t in segs)
        assert played <= MAX_TURNS
        if whole.truncated_by_length:  # what the window kept playing
            assert played > len(whole.turns)
            assert segs[-1].terminated or played == MAX_TURNS or segs[-1].truncated_by_length


def test_every_generated_token_is_in_one_segments_loss_mask_once(setup, windowed):
    eos = setup[3].eos_token_id
    for segs in by_episode(windowed):
        replies = [u.generated for t in segs for u in t.turns]
        masked = []
        for seg in segs:
            mask = seg.loss_mask()
            assert mask.sum() == sum(len(u.generated) for u in seg.turns)
            masked += [tok for tok, m in zip(seg.tokens, mask, strict=True) if m]
        assert masked == [tok for r in replies for tok in r]  # each once, in order
        # The trained samples: one per segment, the same tokens under loss.
        advantages = [np.ones(len(t.turns), np.float32) for t in segs]
        samples, _ = build_samples(segs, advantages, sample_mode="trajectory")
        assert len(samples) == len(segs)
        trained = [tok for s in samples for tok, m in zip(s.tokens, s.loss_mask, strict=True)
                   if m]
        assert trained == masked
        for seg in segs[1:]:  # a rewritten stream starts as context, re-rendered
            assert seg.tokens[: seg.turns[0].context_len].count(eos) >= 1
            assert seg.loss_mask()[: seg.turns[0].context_len].sum() == 0


def test_history_metrics(windowed, full):
    metrics = trajectory_metrics(windowed, "env/")
    episodes = by_episode(windowed)
    assert metrics["rollout/samples_per_episode"] == pytest.approx(
        np.mean([len(e) for e in episodes]))
    assert metrics["rollout/history_rewrites"] == sum(len(e) - 1 for e in episodes)
    assert metrics["rollout/history_tokens_dropped"] > 0
    assert metrics["env/num_turns"] == pytest.approx(
        np.mean([sum(len(t.turns) for t in e) for e in episodes]))
    assert "rollout/history_rewrites" not in trajectory_metrics(full, "env/")
    assert "eval/samples_per_episode" in trajectory_metrics(windowed, "eval/")


def test_continuous_batching_plays_the_same_segments(setup, windowed):
    from flax import nnx

    # A sampler of the same weights that compiles only the slot programs the rollout runs.
    env, params, sampler, formatter, max_input_length, episodes = setup
    lazy = Sampler(nnx.merge(sampler.graphdef, sampler.params), sampler.tokenizer,
                   max_total_len=sampler.max_total_len, precompile_slots=False)
    continuous = play((env, params, lazy, formatter, max_input_length, episodes), "window:1",
                      batching="continuous", slots=4, decode_chunk=4)
    assert [t.traj_id for t in continuous] == [t.traj_id for t in windowed]
    for a, b in zip(continuous, windowed, strict=True):
        assert (a.segment, a.terminated, a.truncated, a.truncated_by_length) == (
            b.segment, b.terminated, b.truncated, b.truncated_by_length)
        assert a.tokens == b.tokens
        assert [u.generated for u in a.turns] == [u.generated for u in b.turns]
        for u, v in zip(a.turns, b.turns, strict=True):
            np.testing.assert_allclose(u.logprobs, v.logprobs, atol=1e-4)


def test_a_segment_is_not_replayed_alone(setup, windowed):
    later = next(t for t in windowed if t.segment > 0)
    with pytest.raises(ValueError, match="joined episode"):
        replay_frames(None, later)


def _turn(reward):
    return Turn(context_len=0, generated=[1], logprobs=np.zeros(1, np.float32),
                stop_reason="eos", eos_appended=False, reward=reward, action=0,
                action_is_valid=True, action_is_effective=True, success=False, done=False,
                state_hash=b"")


def _traj(traj_id, group, member, rewards, segment=0):
    return Trajectory(traj_id=traj_id, group_id=group, tag="lake", seed=group, tokens=[1],
                      turns=[_turn(r) for r in rewards], member=member, segment=segment)


def test_grpo_counts_a_segmented_episode_once_in_its_group():
    # Group 0: member 0 in two segments (rewards 1, 0 | 2: score 3), member 1 whole
    # (score 0.5), member 2 in three segments (0 | 0 | -1: score -1).
    trajs = [_traj(0, 0, 0, [1.0, 0.0]), _traj(1, 0, 1, [0.5]), _traj(2, 0, 2, [0.0]),
             _traj(100, 0, 0, [2.0], segment=1), _traj(200, 0, 2, [0.0], segment=1),
             _traj(201, 0, 2, [-1.0], segment=2)]
    scores = np.array([3.0, 0.5, -1.0])
    expected = (scores - scores.mean()) / (scores.std(ddof=1) + 1e-6)
    out = turn_advantages(trajs, adv_estimator="grpo")
    member = [0, 1, 2, 0, 2, 2]
    for t, a, m in zip(trajs, out, member, strict=True):
        np.testing.assert_allclose(a, np.full(len(t.turns), expected[m]), rtol=1e-5)
    # The joined episode is what the estimator sees: all turns, the reward counted once.
    joined = joined_episode([trajs[0], trajs[3]])
    assert joined.score == 3.0 and len(joined.turns) == 3


class _Lookups(PythonTextEnv):
    """Each reply is answered by one long tool result; done after 8 steps."""

    max_steps_in_episode = 8

    def reset(self, seed):
        self.n = 0
        return "Look things up."

    def step(self, reply):
        self.n += 1
        return PyStep(observation="", reward=0.1, terminated=self.n >= 8,
                      action_is_valid=True, action_is_effective=True, success=self.n >= 8,
                      tool_messages=(f"result {self.n}: " + "x " * 40,))

    def state_hash(self):
        return text_state_hash(str(self.n))


def test_dropped_tool_outputs_continue_a_tool_episode(setup):
    _, _, sampler, formatter, max_input_length, episodes = setup
    runs = {}
    for history in ("full", "drop_tool_outputs:1"):
        runner = PythonRolloutRunner(
            lambda spec, run_seed: _Lookups(), sampler, formatter, tag="lake", max_turns=8,
            max_input_length=max_input_length, history=parse_history(history),
            generation=GenerationConfig(max_tokens_per_step=MAX_NEW))
        runs[history] = runner.run(episodes[:2], sample_seed=0)
    assert all(t.truncated_by_length for t in runs["full"])
    episodes = by_episode(runs["drop_tool_outputs:1"])
    for e, whole in zip(episodes, runs["full"], strict=True):
        # The stubs shrink the history until even they fill the context.
        assert len(e) >= 2 and sum(len(t.turns) for t in e) > len(whole.turns)
        context = formatter.tokenizer.decode(e[1].tokens[: e[1].turns[0].context_len])
        assert "[tool output omitted]" in context and "result 1:" not in context
        assert f"result {len(e[0].turns)}:" in context  # the last result is kept


def test_a_transcript_shows_an_episode_in_segments_once(setup, windowed):
    from jaxrl_agentic.runtime.transcripts import eval_transcripts

    episodes = by_episode(windowed)
    text = eval_transcripts(setup[3].tokenizer, windowed, len(episodes))
    assert text.count("=== episode ") == len(episodes)
    assert text.count("the history was rewritten]") == sum(len(e) - 1 for e in episodes)
    assert text.count("[reply ") == sum(len(t.turns) for t in windowed)
