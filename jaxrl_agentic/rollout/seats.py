"""Rollouts of multi-seat games (`envs/textarena_games.py`): every policy seat is its own
trajectory, and the seats of all games decode together.

    run(episodes):                          # one game per EpisodeSpec
        start every game (random seats move until a policy seat is to move)
        each round r, for every game still going:
            the policy seat to move appends what it saw since its last move to its own
            token stream (its first message: the game's prompt for that player)
        one sampler call for all those seats (the many games' seat 0s and seat 1s alike)
        each reply is that seat's move; the game answers, its random seats move, and
            the seat to move next (the other one, or the same after a forgiven invalid move)
            is the next round's
        at the end each policy seat's last turn gets TextArena's reward for it

Every game makes one policy move per round, so a game's round r is its r-th policy move
whatever else is in the batch: a reply's noise is keyed by (`turns.turn_seed` of the sample
seed and r, the seat's trajectory id), and a game plays the same in any batch.

Trajectories: seat k of episode e (trajectory ids from `traj_id_start`) has id
``traj_id_start + e + k·SEAT_ID_STRIDE`` (ids stay unique when a seat is added to an
episode's id range), its episode's `group_id`, `member` and `seed`, and `seat = k`, which
puts it in a baseline of its own (`algos/estimators._norm_keys`: GRPO compares a seat with
the same seat of the group's other games, the role-conditioned baseline). Random seats have
no trajectory. The trajectories come back seat-0 streams first (in episode order), then
seat 1's: policy seats only.

Ends: a game ends when TextArena says so (terminated: the seats' rewards, zero-sum), when a
seat has made `max_turns` or the game's `max_steps_in_episode` replies, or when a seat's
next prompt would exceed `max_input_length` (that seat `truncated_by_length`); a game cut
short is truncated for both seats, reward 0 each. A start or move that raises ends its game
the same way, logged, with `env_error` 1.0 on its seats' trajectories. Game steps run on the
rollout thread: TextArena's board and card games answer in microseconds, and have no
deadline here (`step_timeout_s` is not applied).

Frozen seats (`"frozen:<k>"`, `"frozen:start"`; `"model:<path>"` likewise, another model of
the policy's shapes): an earlier version of the policy plays the seat through the same
sampler and session, in its own stream, with the params the runner's
`snapshots` (`rollout/snapshots.py`, attached by the pipeline) give for that kind when the
run starts: one version for the whole rollout. Each round makes one sampler call per params
in play (the policy's rows, then each frozen version's rows), with the same seed and row
seeds as a single call would have. A frozen seat's stream is no trajectory of the run (no
sample, no gradient): the last run's are kept in `last_opponents`, with the version they
played in `metrics["frozen_version"]` (−1: another model).

Lockstep only: `batching="continuous"` plays these rounds too (the setting is the run's
for its other environments).
"""

from __future__ import annotations

import logging
from collections.abc import Sequence

import numpy as np

from jaxrl_agentic.data.trajectory import Trajectory
from jaxrl_agentic.envs import INVALID_ACTION
from jaxrl_agentic.envs.metrics import episode_metrics
from jaxrl_agentic.envs.textarena_games import is_opponent_model
from jaxrl_agentic.rollout.groups import EpisodeSpec
from jaxrl_agentic.rollout.turns import (
    GenerationConfig,
    append_prompt,
    check_runner_settings,
    generate_replies,
    turn_seed,
)
from jaxrl_agentic.runtime import timing

SEAT_ID_STRIDE = 1 << 24  # far above any step's episode count
_log = logging.getLogger(__name__)


class SeatRolloutRunner:
    """Plays batches of multi-seat games with one sampler (module doc)."""

    def __init__(self, factory, sampler, formatter, *, tag: str, max_turns: int,
                 max_input_length: int, generation: GenerationConfig, run_seed: int = 0,
                 batching: str = "turn", slots: int = 0, decode_chunk: int = 8):
        check_runner_settings(sampler, max_input_length, generation, batching, slots,
                              decode_chunk)
        self.factory, self.sampler, self.formatter = factory, sampler, formatter
        self.tag, self.max_turns, self.max_input_length = tag, int(max_turns), max_input_length
        self.generation, self.run_seed = generation, int(run_seed)
        self.stats = {"games": 0, "errors": 0, "opponent_moves": 0, "frozen_moves": 0}
        self.snapshots = None  # PolicySnapshots: the frozen seats' params (module doc)
        self.last_opponents: list[Trajectory] = []

    @property
    def frozen_kinds(self) -> tuple[str, ...]:
        """The seat kinds of this runner's games played with other params than the
        policy's (frozen snapshots, other models: they need `snapshots`)."""
        seats = getattr(self.factory, "seats", ())
        return tuple(k for k in dict.fromkeys(seats) if is_opponent_model(k))

    @property
    def trajectories_per_episode(self) -> int:
        """One trajectory per policy seat of a game (the LR schedule's chunk estimate)."""
        return sum(kind == "policy" for kind in getattr(self.factory, "seats", ("policy",)))

    def _frozen_params(self) -> dict[str, tuple[int, object]]:
        if not self.frozen_kinds:
            return {}
        if self.snapshots is None:
            raise RuntimeError(f"{self.tag}: seats {self.frozen_kinds} are played with other "
                               "params than the policy's; give the runner a "
                               "rollout.snapshots.PolicySnapshots (the pipeline attaches one)")
        return {kind: self.snapshots.params_for(kind) for kind in self.frozen_kinds}

    def run(self, episodes: Sequence[EpisodeSpec], *, sample_seed: int,
            traj_id_start: int = 0, params=None, greedy: bool | None = None,
            temperature: float | None = None) -> list[Trajectory]:
        gen = self.generation.overridden(greedy, temperature)
        if hasattr(params, "current"):  # a live policy: lockstep plays one version throughout
            params = params.current()[1]
        games = _Games(self, episodes, traj_id_start)
        games.play(gen, sample_seed=sample_seed, params=params, frozen=self._frozen_params())
        return games.finish()

    def replay_frames(self, traj: Trajectory) -> list[np.ndarray]:
        """A text game has no picture."""
        return []


class _Games:
    """One `run`: the games, their model seats' streams (session row = stream index)."""

    def __init__(self, runner: SeatRolloutRunner, specs: Sequence[EpisodeSpec],
                 traj_id_start: int):
        self.runner, self.specs = runner, list(specs)
        self.matches, self.failed = [], np.zeros(len(self.specs), bool)
        self.trajs: list[Trajectory] = []
        self.row_of: dict[tuple[int, int], int] = {}  # (game, seat) -> stream
        self.game_of: list[tuple[int, int]] = []  # stream -> (game, seat)
        self.frozen: dict[str, tuple[int, object]] = {}  # kind -> (version, params)
        with timing.span("rollout/env"):
            for g, spec in enumerate(self.specs):
                match = runner.factory(spec, runner.run_seed)
                self.matches.append(match)
                try:
                    match.start(spec.seed)
                except Exception as e:
                    self._fail(g, "start", e)
        # Streams of every seat a model plays: policy seats' first, then frozen ones'.
        for frozen in (False, True):
            self._add_streams(frozen, traj_id_start)
        self.live = [not self.failed[g] and not m.done for g, m in enumerate(self.matches)]

    def _add_streams(self, frozen: bool, traj_id_start: int) -> None:
        """A stream per policy seat (or per frozen seat), seat 0s first."""
        runner = self.runner
        for seat in range(max(len(m.seats) for m in self.matches) if self.matches else 0):
            for g, (spec, match) in enumerate(zip(self.specs, self.matches, strict=True)):
                kind = match.seats[seat] if seat < len(match.seats) else "random"
                if kind != "random" and is_opponent_model(kind) == frozen:
                    self.row_of[g, seat] = len(self.trajs)
                    self.game_of.append((g, seat))
                    self.trajs.append(Trajectory(
                        traj_id=traj_id_start + g + seat * SEAT_ID_STRIDE,
                        group_id=spec.group_id, tag=runner.tag, seed=spec.seed, tokens=[],
                        turns=[], member=spec.member, seat=seat))

    def _fail(self, g: int, what: str, error: Exception) -> None:
        spec = self.specs[g]
        _log.warning("two-player game %r seed=%s member=%s: %s raised %s: %s; the game ends "
                     "(env/errors)", self.runner.tag, spec.seed, spec.member, what,
                     type(error).__name__, error)
        self.failed[g] = True

    def _prompt(self, g: int) -> list[int]:
        """The ids the seat to move appends: what it saw since its last move."""
        match, formatter = self.matches[g], self.runner.formatter
        row = self.row_of[g, match.current_seat]
        with timing.span("rollout/env"):
            text = match.observe()
        with timing.span("rollout/tokenize"):
            if not self.trajs[row].tokens:
                return formatter.first_prompt(text)
            return formatter.next_prompt(text)

    def play(self, gen: GenerationConfig, *, sample_seed: int, params,
             frozen: dict[str, tuple[int, object]]) -> None:
        runner = self.runner
        self.frozen = frozen
        session = runner.sampler.new_session(len(self.trajs))
        round_index = 0
        while any(self.live):
            rows = []
            for g in np.flatnonzero(self.live):
                try:
                    ids = self._prompt(g)
                except Exception as e:
                    self._fail(g, "observe", e)
                    self._cut(g)
                    continue
                row = self.row_of[g, self.matches[g].current_seat]
                if append_prompt(self.trajs[row], session, row, ids, runner.max_input_length):
                    rows.append(row)
                else:
                    self._cut(g)
            if not rows:
                break
            replies = {}
            for kind, batch in self._by_kind(rows).items():
                replies.update(generate_replies(
                    session, batch, self.trajs, runner.formatter, gen,
                    params=params if kind == "policy" else frozen[kind][1],
                    seed=turn_seed(sample_seed, round_index)))
            for row in rows:
                g, seat = self.game_of[row]
                match, traj = self.matches[g], self.trajs[row]
                state_hash = b""
                try:
                    with timing.span("rollout/env"):
                        state_hash = match.state_hash()
                        move = match.move(replies[row].reply)
                except Exception as e:
                    self._fail(g, "move", e)
                    traj.turns.append(replies[row].turn(
                        reward=0.0, action=INVALID_ACTION, action_is_valid=False,
                        action_is_effective=False, success=False, done=False,
                        state_hash=state_hash))
                    self._cut(g)
                    continue
                traj.turns.append(replies[row].turn(
                    reward=0.0, action=INVALID_ACTION, action_is_valid=move.valid,
                    action_is_effective=move.valid, success=False, done=move.done,
                    state_hash=state_hash))
                if move.done:
                    self.live[g] = False
                elif len(traj.turns) >= min(runner.max_turns, match.max_steps_in_episode):
                    self._cut(g)
            round_index += 1

    def _kind(self, row: int) -> str:
        g, seat = self.game_of[row]
        return self.matches[g].seats[seat]

    def _by_kind(self, rows: list[int]) -> dict[str, list[int]]:
        """Rows by who plays them: the policy's first, then each frozen kind's."""
        out: dict[str, list[int]] = {}
        for row in sorted(rows, key=lambda r: self._kind(r) != "policy"):
            out.setdefault(self._kind(row), []).append(row)
        return out

    def _cut(self, g: int) -> None:
        """Ends game g before TextArena did: no winner, its seats truncated."""
        self.live[g] = False
        for (game, _seat), row in self.row_of.items():
            if game == g:
                self.trajs[row].truncated = True

    def finish(self) -> list[Trajectory]:
        """Rewards on each seat's last turn, end flags, episode and game metrics."""
        runner = self.runner
        for row, traj in enumerate(self.trajs):
            g, seat = self.game_of[row]
            match = self.matches[g]
            ended = match.done and not self.failed[g]
            traj.terminated = ended
            traj.truncated = not ended
            reward = match.rewards()[seat] if ended else 0.0
            if traj.turns:
                last = traj.turns[-1]
                last.reward, last.done, last.success = reward, ended, ended and reward > 0
            traj.metrics = episode_metrics(
                [u.reward for u in traj.turns],
                [{"action_is_valid": u.action_is_valid,
                  "action_is_effective": u.action_is_effective, "success": u.success}
                 for u in traj.turns])
            traj.metrics.update(match.seat_metrics(seat) if match.base is not None and
                                not self.failed[g] else _failed_seat_metrics(seat))
            traj.metrics["env_error"] = float(self.failed[g])
            traj.metrics["env_timeout"] = 0.0
        policy, runner.last_opponents = [], []
        for row, traj in enumerate(self.trajs):
            kind = self._kind(row)
            if kind == "policy":
                policy.append(traj)
            else:
                traj.metrics["frozen_version"] = float(self.frozen[kind][0])
                runner.last_opponents.append(traj)
        runner.stats["frozen_moves"] += sum(len(t.turns) for t in runner.last_opponents)
        runner.stats["games"] += len(self.matches)
        runner.stats["errors"] += int(self.failed.sum())
        runner.stats["opponent_moves"] += sum(m.opponent_moves for m in self.matches)
        return policy


def _failed_seat_metrics(seat: int) -> dict[str, float]:
    return {"game/win": 0.0, "game/loss": 0.0, "game/draw": 0.0, "game/ended": 0.0,
            "game/invalid_moves": 0.0, "game/invalid_loss": 0.0, "game/seat": float(seat),
            "game/opponent_fallbacks": 0.0}


def seat_rollout_runner(factory, sampler, formatter, *, tag: str, max_turns: int,
                        max_input_length: int, generation: GenerationConfig,
                        run_seed: int = 0, batching: str = "turn", slots: int = 0,
                        decode_chunk: int = 8) -> SeatRolloutRunner:
    """`SeatRolloutRunner` as `rollout.runner.make_runner` builds an environment's own runner
    (`envs.textarena_games.RUNNER`)."""
    return SeatRolloutRunner(factory, sampler, formatter, tag=tag, max_turns=max_turns,
                             max_input_length=max_input_length, generation=generation,
                             run_seed=run_seed, batching=batching, slots=slots,
                             decode_chunk=decode_chunk)
