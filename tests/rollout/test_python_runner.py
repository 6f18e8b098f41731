"""The Python-environment rollout runner: same trajectories as the JAX runner, envs in threads,
and a hung environment step truncates its episode instead of hanging the run."""

import logging
import threading

import jax
import numpy as np
import pytest

from jaxrl_agentic.envs import INVALID_ACTION, make
from jaxrl_agentic.envs.messages import first_message
from jaxrl_agentic.envs.python_env import PyStep, PythonTextEnv, make_python_env, text_state_hash
from jaxrl_agentic.models import load_pretrained
from jaxrl_agentic.rollout.conversation import ChatFormatter
from jaxrl_agentic.rollout.groups import EnvManagerConfig, EpisodeSpec, plan_episodes
from jaxrl_agentic.rollout.loop import RolloutRunner
from jaxrl_agentic.rollout.python_runner import DEFAULT_STEP_TIMEOUT_S, PythonRolloutRunner
from jaxrl_agentic.rollout.turns import GenerationConfig
from jaxrl_agentic.sampling import Sampler

MAX_NEW = 8
ENV = "frozen_lake_slippery"  # slippery: the per-member dynamics noise matters
RUN_SEED = 3


@pytest.fixture(scope="module")
def setup(tiny_model_dir):
    model, tok = load_pretrained(tiny_model_dir)
    formatter = ChatFormatter(tok)
    env, params = make(ENV)
    _, state = env.reset(jax.random.PRNGKey(0), params)
    first_len = len(formatter.first_prompt(first_message(env, state, params)))
    max_input_length = first_len + 3 * 32  # about three turns: the length limit is hit too
    sampler = Sampler(model, tok, max_total_len=max_input_length + MAX_NEW + 1)
    return env, params, sampler, formatter, max_input_length


def python_runner(setup, factory, *, max_turns=6, **kwargs):
    _, _, sampler, formatter, max_input_length = setup
    return PythonRolloutRunner(factory, sampler, formatter, tag="lake", max_turns=max_turns,
                               max_input_length=max_input_length, run_seed=RUN_SEED,
                               generation=GenerationConfig(max_tokens_per_step=MAX_NEW),
                               **kwargs)


def episodes(num_groups, group_size=2, cursor=5):
    manager = EnvManagerConfig(num_env_groups=num_groups, group_size=group_size, tags=("lake",))
    return plan_episodes(manager, split="train", cursor=cursor)["lake"]


def assert_same_trajectory(a, b, *, exact=True):
    assert (a.traj_id, a.group_id, a.tag, a.seed, a.member) == (
        b.traj_id, b.group_id, b.tag, b.seed, b.member)
    assert (a.terminated, a.truncated, a.truncated_by_length) == (
        b.terminated, b.truncated, b.truncated_by_length)
    assert a.tokens == b.tokens
    assert len(a.turns) == len(b.turns)
    for u, v in zip(a.turns, b.turns, strict=True):
        assert (u.context_len, u.generated, u.stop_reason, u.eos_appended, u.reward, u.action,
                u.action_is_valid, u.action_is_effective, u.success, u.done, u.state_hash,
                u.reply) == (
            v.context_len, v.generated, v.stop_reason, v.eos_appended, v.reward, v.action,
            v.action_is_valid, v.action_is_effective, v.success, v.done, v.state_hash,
            v.reply)
        if exact:
            np.testing.assert_array_equal(u.logprobs, v.logprobs)
        else:
            np.testing.assert_allclose(u.logprobs, v.logprobs, atol=1e-5)
    env_side = [{k: v for k, v in t.metrics.items() if k not in ("env_timeout", "env_error")}
                for t in (a, b)]
    assert env_side[0] == env_side[1]


@pytest.mark.parametrize("greedy", [True, False])
def test_adapter_reproduces_the_jax_runner(setup, greedy):
    env, params, sampler, formatter, max_input_length = setup
    jax_runner = RolloutRunner(env, params, sampler, formatter, tag="lake", max_turns=6,
                               max_input_length=max_input_length, run_seed=RUN_SEED,
                               generation=GenerationConfig(max_tokens_per_step=MAX_NEW))
    runner = python_runner(setup, make_python_env(ENV))
    plan = episodes(3)
    want = jax_runner.run(plan, sample_seed=7, traj_id_start=10, greedy=greedy)
    got = runner.run(plan, sample_seed=7, traj_id_start=10, greedy=greedy)
    for a, b in zip(want, got, strict=True):
        assert_same_trajectory(a, b)
        assert b.metrics["env_timeout"] == 0.0
    assert any(t.truncated_by_length for t in got)  # the length rule was exercised
    assert runner.stats == {"resets": 6, "env_steps": sum(len(t.turns) for t in got),
                            "timeouts": 0, "errors": 0}


class InFlight:
    """Thread-safe count of env steps running now, and the most at once."""

    def __init__(self):
        self.lock, self.now, self.peak, self.total = threading.Lock(), 0, 0, 0

    def wrap(self, factory):
        def counted(spec, run_seed):
            return _Counted(factory(spec, run_seed), self)
        return counted


class _Counted(PythonTextEnv):
    def __init__(self, inner, counter):
        self.inner, self.counter = inner, counter
        self.max_steps_in_episode = inner.max_steps_in_episode

    def reset(self, seed):
        return self.inner.reset(seed)

    def step(self, reply):
        c = self.counter
        with c.lock:
            c.now += 1
            c.total += 1
            c.peak = max(c.peak, c.now)
        try:
            return self.inner.step(reply)
        finally:
            with c.lock:
                c.now -= 1

    def state_hash(self):
        return self.inner.state_hash()


def test_slow_env_steps_overlap(setup):
    plan = episodes(2)  # 4 episodes, 2 turns: ~0.4 s of env time overlapped, not ~1.6 s
    counter = InFlight()
    runner = python_runner(setup, counter.wrap(make_python_env(ENV, step_delay_s=0.2)),
                           max_turns=2)
    trajs = runner.run(plan, sample_seed=0)
    assert counter.peak == len(plan)  # a turn's steps all ran at once
    assert counter.total == runner.stats["env_steps"] == sum(len(t.turns) for t in trajs)
    # one worker: the same steps, one at a time
    serial = InFlight()
    runner = python_runner(setup, serial.wrap(make_python_env(ENV, step_delay_s=0.02)),
                           max_turns=2, max_workers=1)
    runner.run(plan, sample_seed=0)
    assert serial.peak == 1 and serial.total == counter.total


def test_hung_step_truncates_its_episode_and_the_run_goes_on(setup):
    base = make_python_env(ENV)
    warm = base(EpisodeSpec(seed=0, group_id=0, member=0), RUN_SEED)
    warm.reset(0)  # compile reset/step/render outside the deadline
    warm.step("<answer>Up</answer>")
    plan = episodes(2)

    def factory(spec, run_seed):
        env = base(spec, run_seed)
        if (spec.group_id, spec.member) == (0, 1):
            env.hang_on_step = 0  # sleeps an hour on its first step
        return env

    runner = python_runner(setup, factory, max_turns=3, step_timeout_s=2.0)
    trajs = runner.run(plan, sample_seed=0, greedy=True)
    hung = trajs[1]
    assert hung.truncated and not hung.terminated and not hung.truncated_by_length
    assert hung.metrics["env_timeout"] == 1.0 and runner.stats["timeouts"] == 1
    [turn] = hung.turns  # the reply the model generated is kept, as a well-formed sample
    assert (turn.reward, turn.action, turn.action_is_valid, turn.done) == (
        0.0, INVALID_ACTION, False, False)
    assert turn.generated and turn.state_hash == trajs[0].turns[0].state_hash  # same map
    assert hung.loss_mask().sum() == len(turn.generated)
    # every other episode played as if nothing had hung
    reference = python_runner(setup, base, max_turns=3).run(plan, sample_seed=0, greedy=True)
    for i in (0, 2, 3):
        assert trajs[i].metrics["env_timeout"] == 0.0
        assert_same_trajectory(reference[i], trajs[i], exact=False)
    # the hung thread is still asleep; it does not block the next run
    again = runner.run([EpisodeSpec(seed=4, group_id=9, member=m) for m in (0, 1)],
                       sample_seed=1)
    assert [t.metrics["env_timeout"] for t in again] == [0.0, 0.0]
    assert all(t.turns for t in again) and runner.stats["timeouts"] == 1


class _Tool(PythonTextEnv):
    """A pure-Python environment; `reset` of seed 13 blocks until the test releases it."""

    max_steps_in_episode = 2
    release = threading.Event()

    def __init__(self, fail=False, fail_reset=False):
        self.fail, self.fail_reset = fail, fail_reset

    def reset(self, seed):
        if self.fail_reset:
            raise OSError("server gone")
        if seed == 13:
            self.release.wait(60)
        self.log = [str(seed)]
        return "Reply with one word."

    def step(self, reply):
        if self.fail:
            raise ValueError("tool crashed")
        self.log.append(reply)
        return PyStep(observation="Noted.", reward=0.5, terminated=False, action_is_valid=True,
                      action_is_effective=True, success=False)

    def state_hash(self):
        return text_state_hash("\n".join(self.log))


def test_pure_python_env_reset_timeout_and_errors(setup, caplog):
    runner = python_runner(setup, lambda spec, run_seed: _Tool(), step_timeout_s=1.0)
    try:
        trajs = runner.run([EpisodeSpec(seed=s, group_id=g, member=0)
                            for g, s in enumerate((1, 13, 2))], sample_seed=0)
    finally:
        _Tool.release.set()
    stuck = trajs[1]
    assert stuck.truncated and stuck.turns == [] and stuck.tokens == []
    assert stuck.metrics["env_timeout"] == 1.0 and stuck.metrics["num_actions"] == 0.0
    for t in (trajs[0], trajs[2]):  # max_steps_in_episode = 2 ended them
        assert t.truncated and len(t.turns) == 2 and t.metrics["env_timeout"] == 0.0
        assert [u.reward for u in t.turns] == [0.5, 0.5] and t.metrics["return"] == 1.0
        assert t.turns[0].state_hash != t.turns[1].state_hash
    assert runner.stats["timeouts"] == 1

    # A step that raises ends its episode (logged, counted), and the run goes on: the reply
    # is kept as a turn with reward 0 and no flag confirmed. A reset that raises leaves an
    # episode without turns. The other episodes play on.
    fails = {2: dict(fail=True), 3: dict(fail_reset=True), 4: {}}
    failing = python_runner(setup, lambda spec, run_seed: _Tool(**fails[spec.seed]))
    assert failing.step_timeout_s == DEFAULT_STEP_TIMEOUT_S > 0  # no hang by default
    with caplog.at_level(logging.WARNING):
        trajs = failing.run([EpisodeSpec(seed=s, group_id=s, member=0) for s in (2, 3, 4)],
                            sample_seed=0)
    step_failed, reset_failed, fine = trajs
    assert step_failed.truncated and len(step_failed.turns) == 1
    [turn] = step_failed.turns
    assert (turn.reward, turn.action, turn.action_is_valid, turn.done) == (
        0.0, INVALID_ACTION, False, False)
    assert reset_failed.truncated and reset_failed.turns == []
    assert [t.metrics["env_error"] for t in trajs] == [1.0, 1.0, 0.0]
    assert [t.metrics["env_timeout"] for t in trajs] == [0.0, 0.0, 0.0]
    assert len(fine.turns) == 2 and failing.stats["errors"] == 2
    assert "episode seed=2 member=0: step raised ValueError: tool crashed" in caplog.text
    assert "episode seed=3 member=0: reset raised OSError: server gone" in caplog.text
    with pytest.raises(ValueError, match="step_timeout_s must be >= 0"):
        python_runner(setup, lambda spec, run_seed: _Tool(), step_timeout_s=-1)


class _Odd(PythonTextEnv):
    """A step whose messages are not text: a tool result left as a number, bytes."""

    def __init__(self, tool_messages=(), observation="Noted."):
        self.tool_messages, self.observation = tool_messages, observation

    def reset(self, seed):
        return "Go."

    def step(self, reply):
        return PyStep(observation=self.observation, reward=1.0, terminated=False,
                      action_is_valid=True, action_is_effective=True, success=False,
                      tool_messages=self.tool_messages)

    def state_hash(self):
        return text_state_hash("s")


def test_a_step_with_messages_that_are_not_text_is_an_env_error(setup, caplog):
    # Not sent (and not str()-ed) into the stream, nor a crash of the rollout's tokenizer:
    # the environment's fault, so its episode ends as an env error, never the policy's.
    odd = {0: dict(tool_messages=(42,)), 1: dict(observation=b"bytes"),
           2: dict(tool_messages="one result"), 3: dict(tool_messages=("42",))}
    runner = python_runner(setup, lambda spec, run_seed: _Odd(**odd[spec.seed]), max_turns=2)
    with caplog.at_level(logging.WARNING):
        trajs = runner.run([EpisodeSpec(seed=s, group_id=s, member=0) for s in range(4)],
                           sample_seed=0)
    assert [t.metrics["env_error"] for t in trajs] == [1.0, 1.0, 1.0, 0.0]
    assert [len(t.turns) for t in trajs] == [1, 1, 1, 2]
    assert [u.reward for t in trajs for u in t.turns] == [0.0, 0.0, 0.0, 1.0, 1.0]
    assert "tool_messages are not a tuple of str (one tool result each): tuple (42,)" \
        in caplog.text
    assert "observation is bytes, not str" in caplog.text
    assert "tool_messages are not a tuple of str (one tool result each): str 'one result'" \
        in caplog.text
