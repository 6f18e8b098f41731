"""One turn's bookkeeping, shared by both schedules and both environment sides.

A schedule (`loop.play_turns`, `continuous.play_continuous`) moves episodes through turns;
an environment side (`loop.JaxEpisodes`, `python_runner.PythonEpisodes`) steps them. What a
turn does to an episode is the same in all four: its next user message is appended to the
token stream and checked against `max_input_length` (`append_prompt`), its reply is appended
and, when it stopped without EOS, closed with an EOS the model did not generate
(`close_reply`), and the environment's answer is recorded, ending the episode when it should
(`record_turn`). A reply's noise is keyed by (`turn_seed`, the episode id) only.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Sequence
from typing import NamedTuple

import numpy as np

from jaxrl_agentic.data.trajectory import Trajectory, Turn
from jaxrl_agentic.envs import episode_metrics
from jaxrl_agentic.rollout.batching import check_batching
from jaxrl_agentic.rollout.groups import EpisodeSpec
from jaxrl_agentic.runtime import timing
from jaxrl_agentic.sampling import SamplerSession


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

    def overridden(self, greedy: bool | None = None,
                   temperature: float | None = None) -> GenerationConfig:
        """This config with the overrides that are not None (an eval's decoding)."""
        changes = {"greedy": greedy, "temperature": temperature}
        return dataclasses.replace(self, **{k: v for k, v in changes.items() if v is not None})


class EnvOutcome(NamedTuple):
    """An environment's answer to one reply, as the rollout loops record it."""

    fields: dict  # the Turn's environment fields (reward, action, …, done, state_hash)
    done: bool  # the environment ended the episode
    timed_out: bool  # the step missed its deadline (the episode ends as truncated)
    next_prompt: Callable[[], list[int]]  # the next user message, tokenised
    # The messages that prompt renders (one user message, or the tool messages), for a
    # history policy's rewrite (`rollout/segments.py`); None for environments without.
    next_messages: Callable[[], list[dict]] | None = None


# ---- a turn of an episode -----------------------------------------------------------------

def check_runner_settings(sampler, max_input_length: int, generation: GenerationConfig,
                          batching: str, slots: int, decode_chunk: int) -> None:
    """The rules every rollout runner's settings keep (one line each, ValueError)."""
    need = max_input_length + generation.max_tokens_per_step + 1
    if sampler.max_total_len < need:
        raise ValueError(f"sampler max_total_len={sampler.max_total_len} < max_input_length + "
                         f"max_tokens_per_step + 1 = {need}")
    check_batching(batching, slots, decode_chunk)


def turn_seed(sample_seed: int, turn_index: int) -> int:
    """The sampling seed of an episode's turn (its noise: this seed folded with its id)."""
    return sample_seed * 100_003 + turn_index


def record_turn(traj: Trajectory, reply: Reply, outcome: EnvOutcome, *, max_steps: int,
                max_turns: int, played_before: int = 0) -> bool:
    """Appends the turn and ends the episode if it should: a step past its deadline ends it
    as truncated, a terminal one as terminated, and `max_steps` environment steps or
    `max_turns` turns (`played_before` of them in the episode's earlier segments) as
    truncated. → whether it goes on."""
    traj.turns.append(reply.turn(**outcome.fields))
    played = played_before + len(traj.turns)
    if outcome.timed_out:
        traj.truncated = True
    elif outcome.done:
        traj.terminated = True
    elif played >= max_steps or played >= max_turns:
        traj.truncated = True
    else:
        return True
    return False


def new_trajectories(episodes: Sequence[EpisodeSpec], tag: str,
                     traj_id_start: int) -> list[Trajectory]:
    return [Trajectory(traj_id=traj_id_start + i, group_id=e.group_id, tag=tag, seed=e.seed,
                       tokens=[], turns=[], member=e.member)
            for i, e in enumerate(episodes)]


# ---- the conversation side of a turn (shared with python_runner.py) --------------------------


class Reply(NamedTuple):
    """One generated reply, as appended to its episode's stream."""

    context_len: int  # stream length before the reply
    ids: list[int]
    logprobs: np.ndarray
    stop_reason: str
    eos_appended: bool  # the code closed the reply with EOS (loss mask 0)
    reply: str  # decoded text, for the environment's parser
    versions: np.ndarray | None = None  # the policy version of each token (in-flight updates)

    def turn(self, **env_fields) -> Turn:
        return Turn(context_len=self.context_len, generated=list(self.ids),
                    logprobs=np.asarray(self.logprobs, np.float32),
                    stop_reason=self.stop_reason, eos_appended=self.eos_appended,
                    reply=self.reply, versions=self.versions, **env_fields)


def append_prompts(segments, session: SamplerSession, pending: dict[int, list[int]],
                   active: np.ndarray, max_input_length: int) -> list[int]:
    """`EpisodeSegments.append_prompt` for each active episode (session row = episode
    index); those whose prompt would not fit, rewritten or not, are no longer active.
    → rows that go on."""
    rows = []
    for i in map(int, np.flatnonzero(active)):
        if segments.append_prompt(i, session, i, pending.pop(i), max_input_length):
            rows.append(i)
        else:
            active[i] = False
    return rows


def append_prompt(traj: Trajectory, session: SamplerSession, row: int, ids: list[int],
                  max_input_length: int) -> bool:
    """Appends an episode's next user message to its stream and to session row `row`, or
    ends it (truncated by length) when the prompt would not fit. → whether it goes on.

    The check runs on the real current stream, the exact prompt the sampler will see."""
    if len(traj.tokens) + len(ids) > max_input_length:
        traj.truncated = traj.truncated_by_length = True
        return False
    traj.tokens.extend(ids)
    session.extend([row], [ids])
    return True


def generate_replies(session: SamplerSession, rows: list[int], trajs: list[Trajectory],
                     formatter, gen: GenerationConfig, *, params, seed: int,
                     row_seeds: list[int] | None = None) -> dict[int, Reply]:
    """One batched generation for `rows`; each reply is appended to its stream, and one that
    stopped without EOS is closed with an EOS the model did not generate (loss mask 0).
    Row r's noise is keyed by `row_seeds[r]` (default: its trajectory's id)."""
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
        row_seeds=row_seeds or [t.traj_id for t in trajs],
    )
    return {row: close_reply(session, row, trajs[row], ids, logprobs, reason, formatter)
            for row, ids, logprobs, reason in zip(rows, out.tokens, out.logprobs,
                                                  out.stop_reasons, strict=True)}


def close_reply(session: SamplerSession, row: int, traj: Trajectory, ids: list[int],
                logprobs: np.ndarray, reason: str, formatter,
                versions: np.ndarray | None = None) -> Reply:
    """Appends a generated reply to its episode's stream (the session holds it already);
    one that stopped without EOS is closed with an EOS the model did not generate."""
    context_len = len(traj.tokens)
    traj.tokens.extend(ids)
    eos_appended = reason != "eos"
    if eos_appended:
        session.extend([row], [[formatter.eos_token_id]])
        traj.tokens.append(formatter.eos_token_id)
    with timing.span("rollout/tokenize"):
        reply = formatter.decode_reply(ids)
    return Reply(context_len, ids, logprobs, reason, eos_appended, reply, versions)


@timing.spanned("rollout/env")
def set_episode_metrics(trajs: list[Trajectory]) -> None:
    for t in trajs:
        t.metrics = episode_metrics(
            [turn.reward for turn in t.turns],
            [{"action_is_valid": u.action_is_valid,
              "action_is_effective": u.action_is_effective,
              "success": u.success} for u in t.turns],
        )
