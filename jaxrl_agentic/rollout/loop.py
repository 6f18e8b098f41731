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
steps, after `max_turns` turns, or when its next prompt would not fit.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from typing import NamedTuple

import jax
import jax.numpy as jnp
import numpy as np

from jaxrl_agentic import timing
from jaxrl_agentic.data.trajectory import Trajectory, Turn
from jaxrl_agentic.envs import INVALID_ACTION, episode_metrics
from jaxrl_agentic.envs.messages import feedback_message, first_message  # noqa: F401 (re-exported)
from jaxrl_agentic.rollout.conversation import ChatFormatter
from jaxrl_agentic.rollout.groups import EpisodeSpec
from jaxrl_agentic.sampler import Sampler


@dataclasses.dataclass(frozen=True)
class GenerationConfig:
    max_tokens_per_step: int = 64
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0
    greedy: bool = False
    # Token ids that end a reply besides EOS (e.g. a closing tag's id); the chat is then
    # closed with an EOS the model did not generate (loss mask 0), as at the length limit.
    stop_token_ids: tuple[int, ...] = ()


class RolloutRunner:
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
    ):
        need = max_input_length + generation.max_tokens_per_step + 1
        if sampler.max_total_len < need:
            raise ValueError(
                f"sampler max_total_len={sampler.max_total_len} < max_input_length + "
                f"max_tokens_per_step + 1 = {need}"
            )
        self.env, self.env_params = env, env_params
        self.sampler, self.formatter = sampler, formatter
        self.tag, self.max_turns, self.max_input_length = tag, max_turns, max_input_length
        self.generation = generation
        self.base_key = jax.random.PRNGKey(run_seed)
        self._reset = jax.jit(jax.vmap(env.reset_env, in_axes=(0, None)))
        self._step = jax.jit(jax.vmap(env.step_env, in_axes=(0, 0, 0, None)))
        # For replays; built once: the un-jitted reset's while_loop would compile every call.
        self._reset_one = jax.jit(env.reset_env)
        self._step_one = jax.jit(env.step_env)
        self._where = jax.jit(_rows_where)

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

    def run(
        self,
        episodes: Sequence[EpisodeSpec],
        *,
        sample_seed: int,
        traj_id_start: int = 0,
        params=None,
        greedy: bool | None = None,
    ) -> list[Trajectory]:
        """Plays `episodes` to the end; `greedy` overrides the generation config (eval)."""
        env, p, gen = self.env, self.env_params, self.generation
        if greedy is not None:
            gen = dataclasses.replace(gen, greedy=greedy)
        n = len(episodes)
        map_keys, noise_keys = self._episode_keys(episodes)
        with timing.span("rollout/env"):
            _, states = self._reset(map_keys, p)
            host = jax.device_get(states)
        trajs = [
            Trajectory(traj_id=traj_id_start + i, group_id=e.group_id, tag=self.tag, seed=e.seed,
                       tokens=[], turns=[], member=e.member)
            for i, e in enumerate(episodes)
        ]
        session = self.sampler.new_session(n)
        active = np.ones(n, bool)
        with timing.span("rollout/env"):
            messages = [first_message(env, _row(host, i), p) for i in range(n)]
        with timing.span("rollout/tokenize"):
            pending = {i: self.formatter.first_prompt(m) for i, m in enumerate(messages)}
        max_steps = int(p.max_steps_in_episode)
        for turn_index in range(self.max_turns):
            # 1. append the new user messages; end episodes whose prompt would not fit
            rows = append_prompts(trajs, session, pending, active, self.max_input_length)
            if not rows:
                break
            # 2. one batched generation for every running episode; 3. close the replies
            replies = generate_replies(session, rows, trajs, self.formatter, gen, params=params,
                                       seed=sample_seed * 100_003 + turn_index)
            actions = np.full(n, INVALID_ACTION, np.int32)
            with timing.span("rollout/env"):
                for row, r in replies.items():
                    action = env.parse_action(r.reply)
                    actions[row] = INVALID_ACTION if action is None else action
            # 4. step every environment at once; finished ones keep their state
            step_keys = jax.vmap(jax.random.fold_in, in_axes=(0, None))(noise_keys, turn_index)
            with timing.span("rollout/env"):
                _, stepped, reward, terminated, info = self._step(
                    step_keys, states, jnp.asarray(actions), p
                )
                stepping = np.zeros(n, bool)
                stepping[rows] = True
                new_states = self._where(jnp.asarray(stepping), stepped, states)
                reward, terminated, info, new_host = jax.device_get(
                    (reward, terminated, info, new_states)
                )
                hashes = {row: env.state_hash(_row(host, row)) for row in rows}
            for row in rows:
                done = bool(terminated[row])
                trajs[row].turns.append(replies[row].turn(
                    reward=float(reward[row]),
                    action=int(actions[row]),
                    action_is_valid=bool(info["action_is_valid"][row]),
                    action_is_effective=bool(info["action_is_effective"][row]),
                    success=bool(info["success"][row]),
                    done=done,
                    state_hash=hashes[row],
                ))
                if done:
                    trajs[row].terminated = True
                    active[row] = False
                elif len(trajs[row].turns) >= max_steps or turn_index == self.max_turns - 1:
                    trajs[row].truncated = True
                    active[row] = False
                else:
                    with timing.span("rollout/env"):
                        message = feedback_message(env, _row(new_host, row), p,
                                                   float(reward[row]), int(actions[row]))
                    with timing.span("rollout/tokenize"):
                        pending[row] = self.formatter.next_prompt(message)
            states, host = new_states, new_host
        set_episode_metrics(trajs)
        return trajs


# ---- the conversation side of a turn (shared with python_runner.py) --------------------------


class Reply(NamedTuple):
    """One generated reply, as appended to its episode's stream."""

    context_len: int  # stream length before the reply
    ids: list[int]
    logprobs: np.ndarray
    stop_reason: str
    eos_appended: bool  # the code closed the reply with EOS (loss mask 0)
    reply: str  # decoded text, for the environment's parser

    def turn(self, **env_fields) -> Turn:
        return Turn(context_len=self.context_len, generated=list(self.ids),
                    logprobs=np.asarray(self.logprobs, np.float32),
                    stop_reason=self.stop_reason, eos_appended=self.eos_appended,
                    reply=self.reply, **env_fields)


def append_prompts(trajs: list[Trajectory], session, pending: dict[int, list[int]],
                   active: np.ndarray, max_input_length: int) -> list[int]:
    """Appends each active episode's pending user message to its stream and the session;
    ends (truncated by length) those whose prompt would not fit. → rows that go on.

    The check runs on the real current stream, the exact prompt the sampler will see."""
    rows = []
    for i in np.flatnonzero(active):
        ids = pending.pop(int(i))
        if len(trajs[i].tokens) + len(ids) > max_input_length:
            trajs[i].truncated = trajs[i].truncated_by_length = True
            active[i] = False
            continue
        trajs[i].tokens.extend(ids)
        session.extend([int(i)], [ids])
        rows.append(int(i))
    return rows


def generate_replies(session, rows: list[int], trajs: list[Trajectory], formatter,
                     gen: GenerationConfig, *, params, seed: int) -> dict[int, Reply]:
    """One batched generation for `rows`; each reply is appended to its stream, and one that
    stopped without EOS is closed with an EOS the model did not generate (loss mask 0)."""
    out = session.generate(
        rows,
        max_new_tokens=gen.max_tokens_per_step,
        temperature=gen.temperature,
        top_p=gen.top_p,
        top_k=gen.top_k,
        greedy=gen.greedy,
        seed=seed,
        stop_token_ids=list(gen.stop_token_ids) or None,
        params=params,
        # Noise keyed by episode id: the same episode samples the same reply in any batch
        # and on any process.
        row_seeds=[t.traj_id for t in trajs],
    )
    replies = {}
    for row, ids, logprobs, reason in zip(rows, out.tokens, out.logprobs, out.stop_reasons,
                                          strict=True):
        context_len = len(trajs[row].tokens)
        trajs[row].tokens.extend(ids)
        eos_appended = reason != "eos"
        if eos_appended:
            session.extend([row], [[formatter.eos_token_id]])
            trajs[row].tokens.append(formatter.eos_token_id)
        with timing.span("rollout/tokenize"):
            reply = formatter.decode_reply(ids)
        replies[row] = Reply(context_len, ids, logprobs, reason, eos_appended, reply)
    return replies


@timing.spanned("rollout/env")
def set_episode_metrics(trajs: list[Trajectory]) -> None:
    for t in trajs:
        t.metrics = episode_metrics(
            [turn.reward for turn in t.turns],
            [{"action_is_valid": u.action_is_valid,
              "action_is_effective": u.action_is_effective,
              "success": u.success} for u in t.turns],
        )


def replay_frames(runner, traj: Trajectory) -> list[np.ndarray]:
    """RGB frames of an episode played by `runner` (a `RolloutRunner` or a
    `PythonRolloutRunner`); [] when its environment cannot draw itself."""
    return runner.replay_frames(traj)


def _rows_where(rows: jax.Array, on_true, on_false):
    """Per-row select between two batched pytrees (`rows` is [batch] bool)."""
    def select(a, b):
        return jnp.where(rows.reshape(rows.shape + (1,) * (a.ndim - 1)), a, b)

    return jax.tree.map(select, on_true, on_false)


def _row(tree, i: int):
    return jax.tree.map(lambda x: x[i], tree)
