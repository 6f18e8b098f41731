"""The multi-turn rollout loop for host-side Python environments (`envs/python_env.py`).

Same conversation, truncation rules, sampler calls and trajectories as `RolloutRunner`
(`loop.py`), with the environment side run in a thread pool at environment granularity:
each episode's env is built and reset, then stepped, on a worker thread (`PythonEpisodes`).
In turn lockstep all of a turn's steps are submitted at once and waited on together, so
slow environments (tool calls) overlap each other while the sampler waits for the slowest;
with `batching="continuous"` (`continuous.py`) each step is submitted when its reply ends
and the other slots keep decoding while it runs.

Timeouts and errors. Every reset and step must finish within `step_timeout_s` seconds of its
submission (default `DEFAULT_STEP_TIMEOUT_S`; 0 = no deadline; with `max_workers` below the
number of episodes, time spent queued counts, and a hung call keeps its worker), and must
not raise. A call that misses its deadline or raises ends its episode as truncated instead
of hanging or ending the run:

- such a step is still recorded as a Turn (the model did generate those tokens, so the
  sample stays well formed) with reward 0, action -1, `action_is_valid`,
  `action_is_effective`, `success` and `done` all False (the environment never confirmed
  any of them), and the state hash of the state the reply answered;
- such a reset leaves an episode without turns (resets are waited on together, in both
  schedules); it gives no sample and does not enter its group's statistics
  (`algos/advantages.turn_advantages` skips episodes without turns);
- either way `truncated` is True, `metrics["env_timeout"]` (late) or `metrics["env_error"]`
  (raised) is 1.0 (0.0 for every other episode), `stats["timeouts"]` / `stats["errors"]`
  counts it, and a raised call is logged with its episode and exception. A reset that
  returns no str, a step that returns no `PyStep`, or one whose `observation` is not a
  str or whose `tool_messages` are not a tuple of str, counts as one that raised.

A run whose every episode fails so three steps in a row stops (`train.py`, exit code 4).

Tool environments (`envs/tools.py`): the first prompt lists the env's `tool_schemas` through
the chat template, a step with `tool_messages` is answered with those `tool` messages (not
a user message), and each episode's metrics get `tool/calls`, `tool/errors` and
`tool/timeouts` (sums over its steps; `envs.tools.tool_metrics` aggregates a batch).

A hung call's thread cannot be killed: it runs on a daemon thread of a pool made for this
`run()` alone, which is abandoned, never joined, so neither later runs nor interpreter exit
wait for it. Note that the first call of a JAX-backed env compiles inside its deadline.
"""

from __future__ import annotations

import concurrent.futures
import contextlib
import functools
import logging
import queue
import threading
import time
from collections.abc import Callable, Iterator, Sequence
from typing import NamedTuple

import numpy as np

from jaxrl_agentic.data.trajectory import Trajectory
from jaxrl_agentic.envs import INVALID_ACTION
from jaxrl_agentic.envs.python_env import PyStep, PythonEnvFactory, PythonTextEnv
from jaxrl_agentic.envs.tools import tool_episode_metrics
from jaxrl_agentic.rollout.conversation import ChatFormatter
from jaxrl_agentic.rollout.groups import EpisodeSpec
from jaxrl_agentic.rollout.history import FULL, HistoryPolicy
from jaxrl_agentic.rollout.loop import EpisodeRunnerBase
from jaxrl_agentic.rollout.turns import EnvOutcome, GenerationConfig
from jaxrl_agentic.runtime import timing
from jaxrl_agentic.sampling import Sampler

_TIMED_OUT = object()
DEFAULT_STEP_TIMEOUT_S = 60.0  # generous for a tool call, yet a hung one ends its episode
_log = logging.getLogger(__name__)


class _Raised(NamedTuple):
    """A reset or step that raised: the exception, handed over instead of its result."""

    error: BaseException


class PythonRolloutRunner(EpisodeRunnerBase):
    """Plays batches of episodes of a Python environment with one sampler."""

    def __init__(
        self,
        env_factory: PythonEnvFactory,
        sampler: Sampler,
        formatter: ChatFormatter,
        *,
        tag: str,
        max_turns: int,
        max_input_length: int,
        generation: GenerationConfig,
        run_seed: int = 0,
        step_timeout_s: float = DEFAULT_STEP_TIMEOUT_S,
        max_workers: int = 0,
        batching: str = "turn",
        slots: int = 0,
        decode_chunk: int = 8,
        history: HistoryPolicy = FULL,
    ):
        self._settings(sampler, formatter, tag=tag, max_turns=max_turns,
                       max_input_length=max_input_length, generation=generation,
                       batching=batching, slots=slots, decode_chunk=decode_chunk,
                       history=history)
        if not callable(env_factory):
            raise TypeError(f"env_factory must be callable (spec, run_seed) -> PythonTextEnv, "
                            f"got {type(env_factory).__name__}")
        if not float(step_timeout_s) >= 0.0:
            raise ValueError(f"step_timeout_s must be >= 0 (0 = no timeout), got "
                             f"{step_timeout_s}")
        if int(max_workers) < 0:
            raise ValueError(f"max_workers must be >= 0 (0 = one per episode), got "
                             f"{max_workers}")
        self.env_factory = env_factory
        self.run_seed = int(run_seed)
        self.step_timeout_s = float(step_timeout_s)
        self.max_workers = int(max_workers)
        self.stats = {"resets": 0, "env_steps": 0, "timeouts": 0, "errors": 0}

    @contextlib.contextmanager
    def _environments(self, episodes, trajs) -> Iterator[PythonEpisodes]:
        """The episodes' environments on a thread pool, shut down when the batch ends; a
        batch played to its end adds the timeouts, errors and tool metrics of its episodes."""
        pool = _DaemonThreadPool(self.max_workers or max(len(episodes), 1))
        try:
            envs = PythonEpisodes(self, pool, episodes)
            for i in np.flatnonzero(envs.timed_out | envs.failed):  # resets that did not
                trajs[i].truncated = True                            # come back
            yield envs
            self._count(trajs, envs)
        finally:
            pool.shutdown()

    def _count(self, trajs: list[Trajectory], envs: PythonEpisodes) -> None:
        self.stats["env_steps"] += envs.steps_submitted
        self.stats["timeouts"] += int(envs.timed_out.sum())
        self.stats["errors"] += int(envs.failed.sum())
        for i, t in enumerate(trajs):
            t.metrics["env_timeout"] = float(envs.timed_out[i])
            t.metrics["env_error"] = float(envs.failed[i])
            if envs.envs.get(i) is not None and envs.envs[i].tool_schemas:
                t.metrics.update(tool_episode_metrics(envs.steps[i]))

    def replay_frames(self, traj: Trajectory) -> list[np.ndarray]:
        """RGB frames of an episode, replayed on a fresh env from its seed and replies
        (`env.render_rgb()` after the reset and after each step); [] when the environment
        has no picture (`render_rgb()` returns None).

        The replay calls the environment again, on this thread and without the deadline:
        an environment whose steps are not a function of (seed, replies), or whose calls
        have side effects, should not draw itself."""
        spec = EpisodeSpec(seed=traj.seed, group_id=traj.group_id, member=traj.member)
        env = self.env_factory(spec, self.run_seed)
        env.reset(spec.seed)
        first = env.render_rgb()
        if first is None:
            return []
        frames = [np.asarray(first)]
        for turn in traj.turns:
            env.step(turn.reply)
            frames.append(np.asarray(env.render_rgb()))
        return frames


class PythonEpisodes:
    """The environment side of a rollout of Python environments: each episode's env is
    built and reset, then stepped, on `pool`; every call has `step_timeout_s` from its
    submission (see the module doc for what a late one records)."""

    def __init__(self, runner: PythonRolloutRunner, pool: _DaemonThreadPool,
                 episodes: Sequence[EpisodeSpec]):
        self.runner, self.pool, self.episodes = runner, pool, episodes
        n = len(episodes)
        self.envs: dict[int, PythonTextEnv] = {}
        self.hashes: dict[int, bytes] = {}  # hash of the state the next reply answers
        self.steps: dict[int, list[PyStep]] = {i: [] for i in range(n)}
        self.timed_out = np.zeros(n, bool)
        self.failed = np.zeros(n, bool)  # a reset or step raised
        self.steps_submitted = 0
        self._texts: dict[int, str] = {}
        self._in_flight: dict[int, tuple[concurrent.futures.Future, float | None]] = {}
        # 0. build and reset every environment at once
        with timing.span("rollout/env"):
            for i, e in enumerate(episodes):
                self._submit(i, _start_episode, runner.env_factory, e, runner.run_seed)
            started = self._harvest("all", "reset")
        runner.stats["resets"] += n
        for i, result in started:
            if result is _TIMED_OUT:
                self.timed_out[i] = True
            elif isinstance(result, _Raised):
                self.failed[i] = True
            else:
                self.envs[i], self._texts[i], self.hashes[i] = result

    def first_prompts(self) -> dict[int, list[int]]:
        """{episode: first prompt} of the episodes whose reset came back in time."""
        with timing.span("rollout/tokenize"):
            return {i: self.runner.formatter.first_prompt(text, tools=self.envs[i].tool_schemas)
                    for i, text in sorted(self._texts.items())}

    def first_messages(self) -> dict[int, tuple[list[dict], list[dict] | None]]:
        """{episode: ([its first user message], its tool schemas or None)}, for the same
        episodes as `first_prompts`."""
        return {i: ([{"role": "user", "content": text}], self.envs[i].tool_schemas or None)
                for i, text in sorted(self._texts.items())}

    def max_steps(self, episode: int) -> int:
        return self.envs[episode].max_steps_in_episode

    def submit(self, episode: int, reply: str, turn_index: int) -> None:
        self._submit(episode, _step_episode, self.envs[episode], reply)
        self.steps_submitted += 1

    @timing.spanned("rollout/env")
    def collect(self, wait: str = "all") -> list[tuple[int, EnvOutcome]]:
        """The answers of the submitted steps: those back now (`wait="none"`), at least one
        (`"any"`: the first back or past its deadline), or all of them (`"all"`)."""
        outcomes = []
        for episode, result in self._harvest(wait, "step"):
            if result is _TIMED_OUT or isinstance(result, _Raised):
                step, next_hash, late = _TIMEOUT_STEP, self.hashes[episode], True
                if result is _TIMED_OUT:
                    self.timed_out[episode] = True
                else:
                    self.failed[episode] = True
            else:
                (step, next_hash), late = result, False
            self.steps[episode].append(step)
            fields = dict(reward=float(step.reward), action=int(step.action),
                          action_is_valid=bool(step.action_is_valid),
                          action_is_effective=bool(step.action_is_effective),
                          success=bool(step.success), done=step.terminated,
                          state_hash=self.hashes[episode])
            self.hashes[episode] = next_hash
            outcomes.append((episode, EnvOutcome(
                fields, step.terminated, late, functools.partial(self._next_prompt, step),
                functools.partial(_next_messages, step))))
        return outcomes

    def _next_prompt(self, step: PyStep) -> list[int]:
        formatter = self.runner.formatter
        with timing.span("rollout/tokenize"):
            if step.tool_messages:
                return formatter.tool_prompt(step.tool_messages)
            return formatter.next_prompt(step.observation)

    def _submit(self, episode: int, fn, *args) -> None:
        timeout = self.runner.step_timeout_s
        deadline = time.monotonic() + timeout if timeout > 0 else None
        self._in_flight[episode] = (self.pool.submit(fn, *args), deadline)

    def _harvest(self, wait: str, what: str) -> list[tuple[int, object]]:
        """[(episode, fn(*args), `_TIMED_OUT` or `_Raised`)] of the calls done or past their
        deadline, after waiting as `wait` says; a call that raised is logged with its
        episode."""
        if not self._in_flight:
            return []
        if wait != "none":
            deadlines = [d for _, d in self._in_flight.values()]
            timeout = None
            if all(d is not None for d in deadlines):
                last = max(deadlines) if wait == "all" else min(deadlines)
                timeout = max(0.0, last - time.monotonic())
            concurrent.futures.wait(
                [f for f, _ in self._in_flight.values()], timeout=timeout,
                return_when=(concurrent.futures.ALL_COMPLETED if wait == "all"
                             else concurrent.futures.FIRST_COMPLETED))
        now, results = time.monotonic(), []
        for episode, (future, deadline) in list(self._in_flight.items()):
            if not future.done():
                if deadline is None or now < deadline:
                    continue
                future.cancel()  # only takes if it never started (a smaller pool)
                results.append((episode, _TIMED_OUT))
            else:
                try:
                    results.append((episode, future.result()))
                except Exception as exc:
                    e = self.episodes[episode]
                    _log.warning("python env %r episode seed=%s member=%s: %s raised %s: %s; "
                                 "the episode ends (env/errors)", self.runner.tag, e.seed,
                                 e.member, what, type(exc).__name__, exc)
                    results.append((episode, _Raised(exc)))
            del self._in_flight[episode]
        return sorted(results, key=lambda r: r[0])


# What a step that missed its deadline or raised records (see the module docstring).
_TIMEOUT_STEP = PyStep(observation="", reward=0.0, terminated=False, action_is_valid=False,
                       action_is_effective=False, success=False, action=INVALID_ACTION)


def _next_messages(step: PyStep) -> list[dict]:
    """The messages the prompt after `step` renders: its tool results, else its observation."""
    if step.tool_messages:
        return [{"role": "tool", "content": m} for m in step.tool_messages]
    return [{"role": "user", "content": step.observation}]


def _start_episode(factory: PythonEnvFactory, spec: EpisodeSpec, run_seed: int):
    env = factory(spec, run_seed)
    text = env.reset(spec.seed)
    if not isinstance(text, str):
        raise TypeError(f"reset() must return the first user message (str), "
                        f"got {type(text).__name__}")
    return env, text, _checked_hash(env)


def _step_episode(env: PythonTextEnv, reply: str):
    step = env.step(reply)
    if not isinstance(step, PyStep):
        raise TypeError(f"step() must return a PyStep, got {type(step).__name__}")
    # Messages go into the token stream as text: anything else is the environment's fault
    # (an env error, not charged to the policy), caught here rather than in the rollout's
    # tokenizer, where it would end the run.
    if not isinstance(step.observation, str):
        raise TypeError(f"step() returned a PyStep whose observation is "
                        f"{type(step.observation).__name__}, not str")
    if isinstance(step.tool_messages, str) or not all(
            isinstance(m, str) for m in step.tool_messages):
        raise TypeError("step() returned a PyStep whose tool_messages are not a tuple of str "
                        "(one tool result each): "
                        f"{type(step.tool_messages).__name__} {step.tool_messages!r:.80}")
    return step, _checked_hash(env)


def _checked_hash(env: PythonTextEnv) -> bytes:
    h = env.state_hash()
    if not isinstance(h, bytes):
        raise TypeError(f"state_hash() must return bytes (e.g. text_state_hash(...)), "
                        f"got {type(h).__name__}")
    return h


class _DaemonThreadPool:
    """A minimal thread pool on daemon threads.

    `concurrent.futures.ThreadPoolExecutor` joins its workers at interpreter exit, so one
    hung environment would hang the end of the run; these workers are never joined.
    """

    def __init__(self, max_workers: int):
        self._max_workers = max_workers
        self._work: queue.SimpleQueue = queue.SimpleQueue()
        self._threads: list[threading.Thread] = []

    def submit(self, fn: Callable, *args) -> concurrent.futures.Future:
        future = concurrent.futures.Future()
        self._work.put((future, fn, args))
        if len(self._threads) < self._max_workers:
            thread = threading.Thread(target=_work_loop, args=(self._work,), daemon=True,
                                      name=f"python-env-{len(self._threads)}")
            thread.start()
            self._threads.append(thread)
        return future

    def shutdown(self) -> None:
        """Cancels calls not started yet; returns without waiting for running ones."""
        while True:
            try:
                item = self._work.get_nowait()
            except queue.Empty:
                break
            if item is not None:
                item[0].cancel()
        for _ in self._threads:
            self._work.put(None)  # a worker stuck in a hung call exits once it returns


def _work_loop(work: queue.SimpleQueue) -> None:
    while True:
        item = work.get()
        if item is None:
            return
        future, fn, args = item
        if not future.set_running_or_notify_cancel():
            continue
        try:
            result = fn(*args)
        except BaseException as exc:  # handed to the waiting thread
            future.set_exception(exc)
        else:
            future.set_result(result)
