"""The multi-turn rollout loop: environments (vmapped, jitted) ↔ text ↔ sampler, batched.

For every turn, for all episodes still running:

1. render the state as text and append the user message to the episode's token stream
   (token-level: see `conversation.py`); the *current* prompt — the whole stream now — is
   checked against `max_input_length`, and an episode whose next prompt would exceed it ends
   as truncated before generating (peers checked a stale prompt and emitted over-long steps);
2. generate up to `max_tokens_per_step` tokens for all of them in one sampler call, which
   prefills only what was appended since the last turn (prefix reuse);
3. if generation stopped without EOS, append an EOS so the chat stays well formed; it is
   recorded as `eos_appended` and, like every token the model did not generate, carries
   loss mask 0;
4. parse each reply into an action (−1 when there is none: the environment charges the
   format penalty and keeps its state) and step all environments in one vmapped call.

An episode ends when the environment terminates, after `max_steps_in_episode` environment
steps, after `max_turns` turns, or when its next prompt would not fit — unless the env's
history policy (`history.py`) rewrites the history into a prompt that does: the episode then
goes on as a new sample of itself (`segments.py`), in both schedules.

That is the turn-lockstep schedule (`play_turns`, `rollout_batching="turn"`). The runner
splits into an environment side (`JaxEpisodes` here, `python_runner.PythonEpisodes`: submit
a reply, collect outcomes) and a schedule, so `rollout/continuous.py` plays the same
episodes with continuous batching through the same bookkeeping (`turns.py`: `record_turn`,
`close_reply`, the length check) and the same noise keys (`turn_seed`, the episode id).
"""

from __future__ import annotations

import abc
import contextlib
import functools
from collections.abc import Iterator, Sequence

import jax
import jax.numpy as jnp
import numpy as np

from jaxrl_agentic.data.trajectory import Trajectory
from jaxrl_agentic.envs import INVALID_ACTION
from jaxrl_agentic.envs.messages import feedback_message, first_message
from jaxrl_agentic.rollout.batching import check_batching
from jaxrl_agentic.rollout.continuous import play_continuous
from jaxrl_agentic.rollout.conversation import ChatFormatter
from jaxrl_agentic.rollout.groups import EpisodeSpec
from jaxrl_agentic.rollout.history import FULL, HistoryPolicy
from jaxrl_agentic.rollout.segments import EpisodeSegments
from jaxrl_agentic.rollout.turns import (
    EnvOutcome,
    GenerationConfig,
    append_prompts,
    check_runner_settings,
    generate_replies,
    new_trajectories,
    record_turn,
    set_episode_metrics,
    turn_seed,
)
from jaxrl_agentic.runtime import timing
from jaxrl_agentic.sampling import Sampler, SamplerSession


class EpisodeRunnerBase(abc.ABC):
    """What both runners share: their settings and `run`. A runner adds the environment side
    of a batch (`_environments`: `first_prompts()`, `submit`, `collect`, `max_steps`; on
    leaving, what its environments add to the played trajectories)."""

    # Continuous batching: the grid a decode chunk's rows and attention read lengths are
    # rounded up to (`SlotDecoder`'s `chunk_grid`; bench_rollout compares "pow2").
    chunk_grid: str = "1.5x"

    def _settings(self, sampler, formatter: ChatFormatter, *, tag: str, max_turns: int,
                  max_input_length: int, generation: GenerationConfig, batching: str,
                  slots: int, decode_chunk: int, history: HistoryPolicy) -> None:
        check_runner_settings(sampler, max_input_length, generation, batching, slots,
                              decode_chunk)
        self.history = history
        self.sampler, self.formatter = sampler, formatter
        self.tag, self.max_turns, self.max_input_length = tag, max_turns, max_input_length
        self.generation = generation
        self.batching, self.slots, self.decode_chunk = batching, slots, decode_chunk

    @abc.abstractmethod
    def _environments(self, episodes: Sequence[EpisodeSpec],
                      trajs: list[Trajectory]) -> contextlib.AbstractContextManager:
        """The environment side of one batch of `episodes`, for the length of the batch."""

    def run(
        self,
        episodes: Sequence[EpisodeSpec],
        *,
        sample_seed: int,
        traj_id_start: int = 0,
        params=None,
        greedy: bool | None = None,
        temperature: float | None = None,
    ) -> list[Trajectory]:
        """Plays `episodes` to the end; `greedy` and `temperature` override the generation
        config (eval). → their trajectories, an episode's segments (`segments.py`) after
        each other in segment order."""
        gen = self.generation.overridden(greedy, temperature)
        trajs = new_trajectories(episodes, self.tag, traj_id_start)
        with self._environments(episodes, trajs) as envs:
            segments = EpisodeSegments(self.history, self.formatter, trajs, envs)
            play(self.batching, envs, segments, envs.first_prompts(), self.sampler,
                 self.formatter, gen, sample_seed=sample_seed, max_turns=self.max_turns,
                 max_input_length=self.max_input_length, params=params, slots=self.slots,
                 decode_chunk=self.decode_chunk, chunk_grid=self.chunk_grid)
            set_episode_metrics(segments.all_segments())
            segments.record_metrics()
        return segments.all_segments()


class RolloutRunner(EpisodeRunnerBase):
    """Plays batches of episodes of one environment with one sampler (jit once per shape)."""

    def __init__(
        self,
        env,
        env_params,
        sampler: Sampler,
        formatter: ChatFormatter,
        *,
        tag: str,
        max_turns: int,
        max_input_length: int,
        generation: GenerationConfig,
        run_seed: int = 0,
        batching: str = "turn",
        slots: int = 0,
        decode_chunk: int = 8,
        history: HistoryPolicy = FULL,
    ):
        self._settings(sampler, formatter, tag=tag, max_turns=max_turns,
                       max_input_length=max_input_length, generation=generation,
                       batching=batching, slots=slots, decode_chunk=decode_chunk,
                       history=history)
        self.env, self.env_params = env, env_params
        self.base_key = jax.random.PRNGKey(run_seed)
        self._reset = jax.jit(jax.vmap(env.reset_env, in_axes=(0, None)))
        self._step = jax.jit(jax.vmap(env.step_env, in_axes=(0, 0, 0, None)))
        # For replays; built once: the un-jitted reset's while_loop would compile every call.
        self._reset_one = jax.jit(env.reset_env)
        self._step_one = jax.jit(env.step_env)
        self._where = jax.jit(_rows_where)
        self._step_keys = jax.jit(jax.vmap(jax.random.fold_in))

    def replay_frames(self, traj: Trajectory) -> list[np.ndarray]:
        """RGB frames of an episode, re-simulated from its seed and actions (same keys)."""
        env, p = self.env, self.env_params
        spec = EpisodeSpec(seed=traj.seed, group_id=traj.group_id, member=traj.member)
        map_keys, noise_keys = self._episode_keys([spec])
        _, state = self._reset_one(map_keys[0], p)
        frames = [env.render_rgb(state, p)]
        for t, turn in enumerate(traj.turns):
            key = jax.random.fold_in(noise_keys[0], t)
            _, state, _, _, _ = self._step_one(key, state, turn.action, p)
            frames.append(env.render_rgb(state, p))
        return frames

    def _episode_keys(self, episodes: Sequence[EpisodeSpec]):
        map_keys = jnp.stack([jax.random.fold_in(self.base_key, e.seed) for e in episodes])
        # Same map for a group; separate dynamics noise per member.
        noise_keys = jnp.stack(
            [jax.random.fold_in(k, 1 + e.member) for k, e in zip(map_keys, episodes, strict=True)]
        )
        return map_keys, noise_keys

    @contextlib.contextmanager
    def _environments(self, episodes, trajs) -> Iterator[JaxEpisodes]:
        yield JaxEpisodes(self, episodes)


class JaxEpisodes:
    """The environment side of a rollout of a gymnax-API env: all episodes' states in one
    batch; the steps submitted since the last `collect` run as one vmapped call (the
    others keep their state), each with the noise key of its own turn."""

    def __init__(self, runner: RolloutRunner, episodes: Sequence[EpisodeSpec]):
        self.runner = runner
        map_keys, self.noise_keys = runner._episode_keys(episodes)
        with timing.span("rollout/env"):
            _, self.states = runner._reset(map_keys, runner.env_params)
            self.host = jax.device_get(self.states)
        self._queued: dict[int, tuple[int, int]] = {}  # episode -> (action, turn index)

    def first_prompts(self) -> dict[int, list[int]]:
        formatter = self.runner.formatter
        messages = self.first_messages()
        with timing.span("rollout/tokenize"):
            return {i: formatter.first_prompt(m[0]["content"]) for i, (m, _) in messages.items()}

    def first_messages(self) -> dict[int, tuple[list[dict], None]]:
        """{episode: ([its first user message], no tools)}."""
        env, p = self.runner.env, self.runner.env_params
        with timing.span("rollout/env"):
            return {i: ([{"role": "user", "content": first_message(env, _row(self.host, i), p)}],
                        None) for i in range(len(self.noise_keys))}

    def max_steps(self, episode: int) -> int:
        return int(self.runner.env_params.max_steps_in_episode)

    def submit(self, episode: int, reply: str, turn_index: int) -> None:
        with timing.span("rollout/env"):
            action = self.runner.env.parse_action(reply)
        self._queued[episode] = (INVALID_ACTION if action is None else action, turn_index)

    @timing.spanned("rollout/env")
    def collect(self, wait: str = "all") -> list[tuple[int, EnvOutcome]]:
        """Steps every submitted episode (at once; `wait` is moot: a JAX step is here)."""
        if not self._queued:
            return []
        runner, p = self.runner, self.runner.env_params
        n = len(self.noise_keys)
        actions, turns = np.full(n, INVALID_ACTION, np.int32), np.zeros(n, np.int32)
        stepping = np.zeros(n, bool)
        for episode, (action, turn_index) in self._queued.items():
            actions[episode], turns[episode], stepping[episode] = action, turn_index, True
        _, stepped, reward, terminated, info = runner._step(
            runner._step_keys(self.noise_keys, jnp.asarray(turns)), self.states,
            jnp.asarray(actions), p)
        new_states = runner._where(jnp.asarray(stepping), stepped, self.states)
        reward, terminated, info, new_host = jax.device_get(
            (reward, terminated, info, new_states))
        outcomes = []
        for episode in self._queued:
            fields = dict(
                reward=float(reward[episode]),
                action=int(actions[episode]),
                action_is_valid=bool(info["action_is_valid"][episode]),
                action_is_effective=bool(info["action_is_effective"][episode]),
                success=bool(info["success"][episode]),
                done=bool(terminated[episode]),
                state_hash=runner.env.state_hash(_row(self.host, episode)),
            )
            answer = (_row(new_host, episode), fields["reward"], fields["action"])
            outcomes.append((episode, EnvOutcome(
                fields, fields["done"], False, functools.partial(self._next_prompt, *answer),
                functools.partial(self._next_messages, *answer))))
        self._queued = {}
        self.states, self.host = new_states, new_host
        return outcomes

    def _next_prompt(self, state, reward: float, action: int) -> list[int]:
        message = self._next_messages(state, reward, action)[0]["content"]
        with timing.span("rollout/tokenize"):
            return self.runner.formatter.next_prompt(message)

    def _next_messages(self, state, reward: float, action: int) -> list[dict]:
        runner = self.runner
        with timing.span("rollout/env"):
            return [{"role": "user", "content": feedback_message(
                runner.env, state, runner.env_params, reward, action)}]


# ---- the two schedules (shared with python_runner.py) -----------------------------------------

def play(batching: str, envs, segments: EpisodeSegments, pending: dict[int, list[int]],
         sampler: Sampler, formatter, gen: GenerationConfig, *, sample_seed: int,
         max_turns: int, max_input_length: int, params, slots: int = 0,
         decode_chunk: int = 8, chunk_grid: str = "1.5x") -> None:
    """Plays every episode with a first prompt in `pending` to its end, in turn lockstep
    (`play_turns`) or with continuous batching (`rollout/continuous.py`); `envs` is the
    environment side (`JaxEpisodes`, `python_runner.PythonEpisodes`), `segments` holds each
    episode's current trajectory (`segments.trajs`) and continues it past a full context."""
    check_batching(batching, slots, decode_chunk)
    common = dict(sample_seed=sample_seed, max_turns=max_turns,
                  max_input_length=max_input_length, params=params)
    if batching == "continuous":
        play_continuous(envs, segments, pending, sampler, formatter, gen, slots=slots,
                        decode_chunk=decode_chunk, chunk_grid=chunk_grid, **common)
    else:
        if hasattr(params, "current"):  # a live policy: lockstep plays one version throughout
            common["params"] = params.current()[1]
        play_turns(envs, segments, pending, sampler.new_session(len(segments.trajs)),
                   formatter, gen, **common)


def play_turns(envs, segments: EpisodeSegments, pending: dict[int, list[int]],
               session: SamplerSession, formatter, gen: GenerationConfig, *, sample_seed: int,
               max_turns: int, max_input_length: int, params) -> None:
    """Turn lockstep: per turn, one sampler call for every running episode, then every
    environment steps and the next turn waits for all of them."""
    trajs = segments.trajs  # each episode's current segment (a rewrite replaces it)
    active = np.zeros(len(trajs), bool)
    active[list(pending)] = True
    row_seeds = [segments.row_seed(i) for i in range(len(trajs))]
    for turn_index in range(max_turns):
        # 1. append the new user messages; continue (a new segment) or end episodes whose
        #    prompt would not fit
        rows = append_prompts(segments, session, pending, active, max_input_length)
        if not rows:
            break
        # 2. one batched generation for every running episode; 3. close the replies
        replies = generate_replies(session, rows, trajs, formatter, gen, params=params,
                                   seed=turn_seed(sample_seed, turn_index),
                                   row_seeds=row_seeds)
        # 4. step every environment; record the turns; the next prompts of those going on
        for row in rows:
            segments.replied(row, replies[row])
            envs.submit(row, replies[row].reply, turn_index)
        for row, outcome in envs.collect("all"):
            if record_turn(trajs[row], replies[row], outcome, max_steps=envs.max_steps(row),
                           max_turns=max_turns, played_before=segments.turns_before[row]):
                pending[row] = outcome.next_prompt()
                segments.answered(row, outcome)
            else:
                active[row] = False


def replay_frames(runner, traj: Trajectory) -> list[np.ndarray]:
    """RGB frames of an episode played by `runner` (a `RolloutRunner` or a
    `PythonRolloutRunner`); [] when its environment cannot draw itself. An episode in
    segments replays from its start: give it joined (`data.trajectory.joined_episode`)
    or its first segment, whose frames are the episode's first part."""
    if traj.segment > 0:  # its first turn answers a state the replay never reaches
        raise ValueError(f"trajectory {traj.traj_id} is segment {traj.segment} of its "
                         "episode: replay the joined episode (joined_episode) instead")
    return runner.replay_frames(traj)


def _rows_where(rows: jax.Array, on_true, on_false):
    """Per-row select between two batched pytrees (`rows` is [batch] bool)."""
    def select(a, b):
        return jnp.where(rows.reshape(rows.shape + (1,) * (a.ndim - 1)), a, b)

    return jax.tree.map(select, on_true, on_false)


def _row(tree, i: int):
    return jax.tree.map(lambda x: x[i], tree)
