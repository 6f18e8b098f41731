"""`textarena:<EnvId>` for TextArena's two-player games: one game, a seat per player.

    factory = make_python_env("textarena:TicTacToe-v0", seats=("policy", "random"))
    match = factory(EpisodeSpec(seed=7, group_id=0, member=0), run_seed=0)
    match.start(7)                    # TextArena's game 7; random seats move until a policy
    seat, text = match.current_seat, match.observe()   # seat is to move: what it sees
    move = match.move("[4]")          # -> SeatMove: whether it was valid, whether it ended

`seats` names who plays each of TextArena's players, in player order: `"policy"` (the
model, through the sampler: `rollout/seats.py` plays every policy seat's turns in its own
conversation) or `"random"` (a random move among those the game lists to that player, e.g.
TicTacToe's `Available Moves: '[0]', '[4]'` or Kuhn Poker's `'[check]', '[bet]'`; a game
that lists none gets `random_fallback_reply`, counted). The default is self-play,
`("policy", "policy")`. With `alternate_seats` the seats are swapped in the episodes of odd
groups (evaluation against `random` with the policy in seat 0 on even groups, seat 1 on
odd ones: validation's group g plays seed 2g + 1).

What a seat sees is TextArena's per-player observation (`get_observation()` when that
player is to move: the messages for it since its last move, its private ones included, as
`LLMObservationWrapper` shows them, one `[GAME] ...` / `[Player k] ...` line each), without
the echo of its own action (the reply itself). The opponent's action is shown as TextArena
shows it. A seat never sees another seat's private messages (a Kuhn Poker card).

Outcome: TextArena's `close()` rewards, zero-sum: +1 win, −1 loss, 0 draw, on each policy
seat's last turn (a game cut short by the turn limits or a prompt over `max_input_length`
has no winner: 0 each). Invalid moves are TextArena's to judge: `TwoPlayerState` forgives
`error_allowance` (1) in a row (the seat moves again, told why) and the next one loses the
game. `format_penalty` does not apply (the reward stays the zero-sum outcome); invalid
moves are counted per seat (`game/invalid_moves`) and marked on their turns
(`action_is_valid` False).

Played by a one-stream runner instead (`PythonRolloutRunner`: the format warm-up), a match
is the view of its first policy seat with every other seat random (`reset` / `step`).

Ids: the two-player games of TextArena's registry whose module builds a `TwoPlayerState`
and compiles, except those that need the network (`NEEDS_NETWORK`).
"""

from __future__ import annotations

import dataclasses
import os
import random
import re
from collections.abc import Sequence
from functools import lru_cache
from typing import Any

from jaxrl_agentic.envs import thread_random
from jaxrl_agentic.envs.base import INVALID_ACTION
from jaxrl_agentic.envs.python_env import PyStep, PythonTextEnv, text_state_hash
from jaxrl_agentic.envs.textarena_source import (
    PREFIX,
    entry_source,
    import_textarena,
    new_game,
)

SEAT_KINDS = ("policy", "random", "frozen:<k>", "frozen:start", "model:<path>")
FROZEN = "frozen:"  # the policy as it was: k versions ago, or when the run started
MODEL = "model:"  # another model of the policy's shapes: a directory, .gguf or training run
NUM_SEATS = 2
DEFAULT_MAX_STEPS = 100  # replies per seat when the game states no turn limit
DEFAULT_FALLBACK_REPLY = "[0]"
# The runner that plays matches (above this layer, so it is named, not imported).
RUNNER = "jaxrl_agentic.rollout.seats:seat_rollout_runner"
# Two-player games (TextArena 0.7.4) that ask an LLM jury through OpenRouter or download
# NLTK word lists at run time.
NEEDS_NETWORK = frozenset({"Debate", "DontSayIt", "LetterAuction", "ScenarioPlanning",
                           "SpellingBee", "WordChains"})
# A move the game lists to the player: "'[4]'", "'[check]'" (quoted, as TextArena lists them).
_LISTED_MOVE = re.compile(r"'(\[[^\[\]'\n]{1,24}\])'")


@lru_cache(maxsize=1)
def _catalog() -> dict[str, bool]:
    """{two-player id: whether its game module compiles} over TextArena's registry (a game
    is two-player when its module builds a `TwoPlayerState`)."""
    ta = import_textarena("<id>")
    from textarena.envs.registration import ENV_REGISTRY

    catalog = {}
    for env_id, spec in ENV_REGISTRY.items():
        source = entry_source(ta, spec.entry_point)
        if "TwoPlayerState" not in source:
            continue
        try:
            compile(source, env_id, "exec")
            catalog[env_id] = True
        except SyntaxError:
            catalog[env_id] = False
    return catalog


def two_player_ids() -> tuple[str, ...]:
    """TextArena's two-player ids, sorted (variants `-raw` / `-train` included)."""
    return tuple(sorted(_catalog()))


def offline_two_player_ids() -> tuple[str, ...]:
    """The two-player ids that run here: not in `NEEDS_NETWORK`, and their game compiles."""
    return tuple(i for i, ok in sorted(_catalog().items())
                 if ok and i.split("-v", 1)[0] not in NEEDS_NETWORK)


def is_two_player(env_id: str) -> bool:
    return env_id in _catalog()


def _render(ta, state, messages, seat: int) -> str:
    """A seat's new messages as `LLMObservationWrapper` shows them, without its own echo."""
    lines = []
    for sender, message, kind in messages:
        if kind == ta.ObservationType.PLAYER_ACTION and sender == seat:
            continue
        name = "GAME" if sender == ta.GAME_ID else state.role_mapping.get(sender,
                                                                           f"Player {sender}")
        lines.append(f"[{name}] {message}")
    return "\n".join(lines)


def listed_moves(text: str) -> list[str]:
    """The moves the last listing in `text` offers (`'[4]', '[5]'` → ["[4]", "[5]"])."""
    for line in reversed(text.splitlines()):
        found = _LISTED_MOVE.findall(line)
        if found:
            return list(dict.fromkeys(found))
    return []


def random_listed_move_policy(rng, **_unused):
    """The format warm-up's text policy (`warmup.py`) for a two-player game: a random move
    among those the newest messages list to the seat (a legal move: TicTacToe's free cells,
    Kuhn Poker's actions), else one listed earlier in the conversation, else
    DEFAULT_FALLBACK_REPLY. The warmed policy thereby reads the listing before it moves."""
    seen: list[str] = []

    def reply(text: str) -> str:
        seen.append(text)
        moves = listed_moves(text) or listed_moves("\n".join(seen))
        return rng.choice(moves) if moves else DEFAULT_FALLBACK_REPLY

    return reply


@dataclasses.dataclass(frozen=True)
class SeatMove:
    """What one policy seat's reply did."""

    seat: int
    valid: bool  # the game accepted it (a forgiven or losing invalid move: False)
    done: bool  # the game ended


class TextArenaMatch(PythonTextEnv):
    """One game of a TextArena two-player id with its seats (module doc)."""

    def __init__(self, env_id: str, seats: Sequence[str], *, opponent_seed: int,
                 max_steps_in_episode: int = DEFAULT_MAX_STEPS, reply_hint: str | None = None,
                 game_kwargs: dict | None = None,
                 random_fallback_reply: str = DEFAULT_FALLBACK_REPLY):
        self.ta = import_textarena(env_id)
        self.env_id, self.seats = env_id, tuple(seats)
        self.max_steps_in_episode = int(max_steps_in_episode)
        self.reply_hint, self.game_kwargs = reply_hint, dict(game_kwargs or {})
        self.random_fallback_reply = random_fallback_reply
        self._opponent = random.Random(opponent_seed)
        self.game = self.base = None
        self._rng: thread_random.States | None = None
        self._seen: dict[int, list[str]] = {}  # every seat's texts so far
        self.invalid_moves = [0] * NUM_SEATS  # per seat, forgiven ones and a losing one
        self.opponent_moves = self.opponent_fallbacks = 0
        self.done = False
        thread_random.install()

    @property
    def policy_seats(self) -> tuple[int, ...]:
        """The seats trained: their turns are trajectories."""
        return tuple(i for i, kind in enumerate(self.seats) if kind == "policy")

    @property
    def model_seats(self) -> tuple[int, ...]:
        """The seats a model plays through the sampler: the policy's and frozen snapshots'."""
        return tuple(i for i, kind in enumerate(self.seats) if kind != "random")

    # ---- the game, seat by seat (rollout/seats.py) -------------------------------------------
    def start(self, seed: int) -> None:
        """TextArena's game `seed`; random seats play until a policy seat is to move."""
        self._rng, self.game, self.base = new_game(self.ta, self.env_id, self.game_kwargs,
                                                   int(seed), NUM_SEATS)
        self._seen = {i: [] for i in range(NUM_SEATS)}
        self.invalid_moves = [0] * NUM_SEATS
        self.opponent_moves = self.opponent_fallbacks = 0
        self.done = False
        self._play_opponents()

    @property
    def current_seat(self) -> int | None:
        """The seat to move (a policy seat between calls), None once the game ended."""
        return None if self.done else int(self.base.state.current_player_id)

    def observe(self) -> str:
        """The messages for the seat to move since its last move (its first: the game's
        prompt, with `reply_hint`)."""
        seat = self.current_seat
        text = self._pop(seat)
        if len(self._seen[seat]) == 1 and self.reply_hint:
            text = f"{text}\n{self.reply_hint}"
        return text

    def move(self, reply: str) -> SeatMove:
        """The current seat's reply, then the random seats' moves until a policy seat is to
        move or the game ends."""
        seat = self.current_seat
        if seat is None:
            raise RuntimeError("move() after the game ended")
        valid = self._step(str(reply), seat)
        if not valid:
            self.invalid_moves[seat] += 1
        self._play_opponents()
        return SeatMove(seat=seat, valid=valid, done=self.done)

    def rewards(self) -> dict[int, float]:
        """{seat: TextArena's reward} of an ended game; 0 each for a game not ended."""
        if not self.done:
            return dict.fromkeys(range(NUM_SEATS), 0.0)
        rewards, _ = self.game.close()
        return {i: float((rewards or {}).get(i, 0.0)) for i in range(NUM_SEATS)}

    def lost_on_invalid_move(self, seat: int) -> bool:
        return self.done and bool(self.base.state.game_info[seat].get("invalid_move", False))

    def seat_metrics(self, seat: int) -> dict[str, float]:
        """The `game/*` numbers of one seat's trajectory (`game_metrics` averages them)."""
        r = self.rewards()[seat]
        return {"game/win": float(self.done and r > 0), "game/loss": float(self.done and r < 0),
                "game/draw": float(self.done and r == 0), "game/ended": float(self.done),
                "game/invalid_moves": float(self.invalid_moves[seat]),
                "game/invalid_loss": float(self.lost_on_invalid_move(seat)),
                "game/seat": float(seat),
                "game/opponent_fallbacks": float(self.opponent_fallbacks)}

    def state_hash(self) -> bytes:
        if self.base is None:
            raise RuntimeError("state_hash() before start()")
        seat = self.current_seat
        return text_state_hash(self._seen[seat][-1] if seat is not None and self._seen[seat]
                               else "")

    # ---- internals ---------------------------------------------------------------------------
    def _pop(self, seat: int) -> str:
        with thread_random.own_states(self._rng):
            _, messages = self.base.get_observation()
        text = _render(self.ta, self.base.state, messages, seat)
        self._seen[seat].append(text)
        return text

    def _step(self, reply: str, seat: int) -> bool:
        """One move of `seat` → whether the game accepted it."""
        with thread_random.own_states(self._rng):
            done, _ = self.game.step(reply)
        state = self.base.state
        self.done = bool(done)
        if self.done:
            return not bool(state.game_info[seat].get("invalid_move", False))
        # A forgiven invalid move leaves `error_count` > 0 and the same seat to move.
        return not (getattr(state, "error_count", 0) > 0
                    and int(state.current_player_id) == seat)

    def _play_opponents(self) -> None:
        while not self.done and self.seats[self.current_seat] == "random":
            seat = self.current_seat
            self._pop(seat)
            moves = listed_moves("\n".join(self._seen[seat]))
            if moves:
                reply = self._opponent.choice(moves)
            else:
                reply = self.random_fallback_reply
                self.opponent_fallbacks += 1
            self.opponent_moves += 1
            self._step(reply, seat)

    # ---- one stream: the first policy seat, the others random (PythonRolloutRunner) ----------
    def reset(self, seed: int) -> str:
        viewed = self.policy_seats[0]
        self.seats = tuple("policy" if i == viewed else "random" for i in range(NUM_SEATS))
        self.start(seed)
        return self.observe() if not self.done else ""

    def step(self, reply: str) -> PyStep:
        seat = self.policy_seats[0]
        move = self.move(reply)
        reward = self.rewards()[seat] if move.done else 0.0
        text = self.observe() if not move.done else ""
        return PyStep(observation=text, reward=reward, terminated=move.done,
                      action_is_valid=move.valid, action_is_effective=move.valid,
                      success=move.done and reward > 0, action=INVALID_ACTION)


def game_metrics(episode_metrics: Sequence[dict], prefix: str = "") -> dict[str, float]:
    """Rates over the policy seats' trajectories of two-player games (those whose metrics
    hold `game/*`; {} for a batch without them): `win_rate`, `draw_rate`, `loss_rate` (over
    all seats; a game cut short is none of the three), `invalid_moves` (per seat-game, mean),
    `invalid_loss_rate` (games a seat lost on an invalid move), `seat<k>/win_rate`, and the
    random opponents' `opponent_fallbacks` (total)."""
    games = [m for m in episode_metrics if "game/win" in m]
    if not games:
        return {}

    def mean(key, rows):
        return float(sum(m[key] for m in rows) / len(rows)) if rows else 0.0

    out = {f"{prefix}win_rate": mean("game/win", games),
           f"{prefix}draw_rate": mean("game/draw", games),
           f"{prefix}loss_rate": mean("game/loss", games),
           f"{prefix}invalid_moves": mean("game/invalid_moves", games),
           f"{prefix}invalid_loss_rate": mean("game/invalid_loss", games),
           f"{prefix}opponent_fallbacks": float(sum(m["game/opponent_fallbacks"]
                                                    for m in games))}
    for seat in range(NUM_SEATS):
        rows = [m for m in games if m["game/seat"] == seat]
        if rows:
            out[f"{prefix}seat{seat}/win_rate"] = mean("game/win", rows)
    return out


def frozen_versions_back(kind: str) -> int | None:
    """k of a `"frozen:<k>"` seat (k >= 1), 0 for `"frozen:start"`, None for another kind;
    a malformed `frozen:` kind is a ValueError naming the field."""
    if not kind.startswith(FROZEN):
        return None
    k = kind[len(FROZEN):]
    if k == "start":
        return 0
    if not k.isdigit() or int(k) < 1:
        raise ValueError(f"seats: {kind!r}: a frozen seat is 'frozen:<k>' with k >= 1 (the "
                         "policy k versions ago) or 'frozen:start'")
    return int(k)


def is_opponent_model(kind: str) -> bool:
    """Whether a seat of `kind` is played through the sampler with params other than the
    policy's (a frozen snapshot or another model)."""
    return kind.startswith((FROZEN, MODEL))


def check_seats(seats) -> tuple[str, ...]:
    """`seats` as a tuple of NUM_SEATS known kinds, or a one-line error naming the field."""
    if isinstance(seats, str) or not isinstance(seats, Sequence) or len(seats) != NUM_SEATS:
        raise ValueError(f"seats: must list {NUM_SEATS} seat kinds (one per player, "
                         f"each of {', '.join(SEAT_KINDS)}), got {seats!r}")
    bad = [s for s in seats if not isinstance(s, str)
           or (s not in ("policy", "random") and not is_opponent_model(s))]
    if bad:
        raise ValueError(f"seats: unknown seat kind {bad[0]!r}; allowed: "
                         f"{', '.join(SEAT_KINDS)}")
    for kind in seats:
        frozen_versions_back(kind)
        path = os.path.expanduser(kind[len(MODEL):]) if kind.startswith(MODEL) else None
        if path is not None and not os.path.exists(path):
            raise ValueError(f"seats: {kind!r}: no such model directory, .gguf file or "
                             "training run")
    if "policy" not in seats:
        raise ValueError(f"seats: at least one seat must be 'policy', got {tuple(seats)}")
    return tuple(seats)


def two_player_builder(env_id: str, *, seats=("policy", "policy"),
                       alternate_seats: bool = False, max_steps_in_episode: int | None = None,
                       reply_hint: str | None = None, game_kwargs: dict | None = None,
                       random_fallback_reply: str = DEFAULT_FALLBACK_REPLY,
                       format_penalty: float = 0.0, **unknown: Any):
    """`make_python_env("textarena:<two-player id>", **config)`: the match factory.

    seats: who plays each player ("policy" / "random"), default self-play.
    alternate_seats: odd groups play the seats swapped (module doc).
    max_steps_in_episode: replies of one seat before the runner ends the game; default the
        most the game allows, max_turns * (1 + error_allowance), or DEFAULT_MAX_STEPS.
    reply_hint: a line added to each seat's first message.
    game_kwargs: the game's constructor arguments over the id's.
    random_fallback_reply: a random seat's move when the game lists none to it.
    format_penalty: taken and unused (the reward is the game's zero-sum outcome).
    """
    del format_penalty
    if unknown:
        raise ValueError(f"{PREFIX}{env_id}: unknown config {sorted(unknown)}; allowed: "
                         "seats, alternate_seats, max_steps_in_episode, reply_hint, "
                         "game_kwargs, random_fallback_reply")
    seats = check_seats(seats)
    if not isinstance(alternate_seats, bool):
        raise ValueError(f"alternate_seats: must be True or False, got {alternate_seats!r}")
    if alternate_seats and seats[0] == seats[1]:
        raise ValueError(f"alternate_seats: swapping {seats} changes nothing; give one "
                         "'policy' and one 'random' seat")
    if not isinstance(random_fallback_reply, str) or not random_fallback_reply.strip():
        raise ValueError(f"random_fallback_reply: must be a non-empty str, got "
                         f"{random_fallback_reply!r}")
    if reply_hint is not None and (not isinstance(reply_hint, str) or "\n" in reply_hint):
        raise ValueError(f"reply_hint: must be one line of text, got {reply_hint!r}")
    if max_steps_in_episode is not None and (isinstance(max_steps_in_episode, bool) or int(
            max_steps_in_episode) != max_steps_in_episode or max_steps_in_episode < 1):
        raise ValueError(f"max_steps_in_episode: must be an int >= 1, got "
                         f"{max_steps_in_episode!r}")
    if game_kwargs is not None:
        try:
            game_kwargs = {str(k): v for k, v in dict(game_kwargs).items()}
        except (TypeError, ValueError):
            raise ValueError(f"game_kwargs: must be a dict, got {game_kwargs!r}") from None
    if not _catalog()[env_id]:
        raise ValueError(f"{PREFIX}{env_id}: the installed TextArena's source of this game "
                         "does not compile")
    if env_id.split("-v", 1)[0] in NEEDS_NETWORK:
        games = sorted({i.split("-v", 1)[0] for i in offline_two_player_ids()})
        raise ValueError(f"{PREFIX}{env_id} needs the network at run time (an LLM jury or "
                         f"word lists); two-player games that run offline: {', '.join(games)}")
    options = dict(reply_hint=reply_hint, game_kwargs=dict(game_kwargs or {}),
                   random_fallback_reply=random_fallback_reply)
    probe = TextArenaMatch(env_id, ("policy", "policy"), opponent_seed=0, **options)
    try:
        probe.start(0)
    except Exception as e:
        raise ValueError(f"{PREFIX}{env_id} does not start: {type(e).__name__}: {e}") from e
    if max_steps_in_episode is None:
        state = probe.base.state
        turns, allowance = getattr(state, "max_turns", None), getattr(state, "error_allowance",
                                                                      0)
        max_steps_in_episode = (turns * (1 + (allowance or 0)) if turns
                                else DEFAULT_MAX_STEPS)

    def factory(spec, run_seed: int) -> TextArenaMatch:
        swap = alternate_seats and spec.group_id % 2 == 1
        return TextArenaMatch(env_id, seats[::-1] if swap else seats,
                              opponent_seed=(int(run_seed) * 1_000_003 + spec.seed) * 1_009
                              + spec.member,
                              max_steps_in_episode=int(max_steps_in_episode), **options)

    factory.runner = RUNNER  # rollout/runner.py: matches are played seat by seat
    factory.seats = seats  # the kinds in play (frozen ones need policy snapshots)
    return factory
