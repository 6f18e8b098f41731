"""`textarena:<EnvId>`: TextArena's single-player games as host-side environments.

    factory = make_python_env("textarena:FrozenLake-v0", format_penalty=0.1)
    env = factory(EpisodeSpec(seed=7, group_id=0, member=0), run_seed=0)
    text = env.reset(7)        # the game's own prompt and board, as TextArena shows them
    step = env.step("[down]")  # the reply is the game's action; the game parses it

Messages are what TextArena's `LLMObservationWrapper` shows a player, one `[GAME] ...` line
per game message, but only the messages new since the last reply (the chat already holds
the rest): the game's echo of the player's own action is dropped, it is the reply itself.
The reply goes through the id's own action wrappers (`ActionFormattingWrapper` wraps a reply
with no brackets in them, as TextArena plays it); observation wrappers are bypassed.

Outcome (TextArena 0.7.4, `SinglePlayerState`): a game ends with `state.done`; `env.close()`
returns `(rewards, game_info)`, rewards `{0: r}` with r = 1 for a win and the game's
progress fraction (< 1) otherwise; `game_info[0]["invalid_move"]` is set when an invalid
move ended it. An invalid move the game forgives (its `error_allowance`, 1 by default:
every second invalid move in a row ends the game) leaves `state.error_count` > 0.

- reward: 0 until the end, then the game's reward; a forgiven invalid move costs
  `format_penalty` (the game's own penalty only comes with a final invalid move).
- success: the game ended with reward >= 1 and not on an invalid move (Set-v0, whose
  reward is its count of sets found, succeeds with one set).
- action_is_valid: the game accepted the move; action_is_effective is the same (TextArena
  does not say whether a move changed anything). `PyStep.action` is always -1 (no ids).
- observation: the new messages; on the last step also the game's closing `reason`
  (in `game_info` only), for logs: the runner sends no message after the last step.

Seeds: `reset(seed)` plays TextArena's game `seed` (`env.reset(num_players=1, seed=seed)`,
which seeds Python's global `random`); `run_seed` does not change the games, so a seed is
the same game as in TextArena itself. Games draw from the global `random` during steps
too (2048 tiles, card deals, Minesweeper's mines on the first click), so each episode keeps
its own `random` and numpy states (numpy seeded with the seed as well, in case a game draws
from it): around each of its calls the module functions draw from them on that thread
(`envs/thread_random.py`). An episode is a function of (seed, replies) whatever other
episodes run on other threads, and no lock is shared: a game that hangs or raises stops
only its own episode.

Ids: any single-player id of TextArena's registry (variants such as `-raw`, no action
wrapper, and `-train` included), except those that need the network (`NEEDS_NETWORK`).
TextArena is imported by the builder, not by this module.
"""

from __future__ import annotations

import difflib
import re
from functools import lru_cache
from typing import Any

from jaxrl_agentic.envs import thread_random
from jaxrl_agentic.envs.base import INVALID_ACTION
from jaxrl_agentic.envs.python_env import PyStep, PythonTextEnv, text_state_hash
from jaxrl_agentic.envs.registry import register_prefix
from jaxrl_agentic.envs.textarena_source import (
    PREFIX,
    entry_source,
    import_textarena,
    new_game,
    unwrap,
)

# When the game states no turn limit: steps before the runner ends the episode.
DEFAULT_MAX_STEPS = 100
# Games (TextArena 0.7.4) that download NLTK word lists at run time or ask an LLM judge
# through OpenRouter: they cannot run offline. Matched on the id's name before "-v".
NEEDS_NETWORK = frozenset({"GuessWho", "Hangman", "TwentyQuestions", "WordLadder",
                           "WordSearch", "Wordle"})


def _game_name(env_id: str) -> str:
    return env_id.split("-v", 1)[0]


@lru_cache(maxsize=1)
def _catalog() -> dict[str, bool]:
    """{single-player id: whether its game module compiles} over TextArena's registry. A
    game is single-player when its module builds a `SinglePlayerState` (the registry does
    not record player counts); TextArena 0.7.4 ships two that do not compile (Klondike,
    UltimateTexasHoldem), found by compiling, not importing, the source."""
    ta = import_textarena("<id>")
    from textarena.envs.registration import ENV_REGISTRY

    catalog, compiles = {}, {}
    for env_id, spec in ENV_REGISTRY.items():
        source = entry_source(ta, spec.entry_point)
        if "SinglePlayerState" not in source:
            continue
        if source not in compiles:
            try:
                compile(source, env_id, "exec")
                compiles[source] = True
            except SyntaxError:
                compiles[source] = False
        catalog[env_id] = compiles[source]
    return catalog


def single_player_ids() -> tuple[str, ...]:
    """TextArena's single-player ids, sorted (variants `-raw` / `-train` included)."""
    return tuple(sorted(_catalog()))


def offline_ids() -> tuple[str, ...]:
    """The single-player ids that run here: not in `NEEDS_NETWORK`, and their game loads."""
    return tuple(i for i, loads in sorted(_catalog().items())
                 if loads and _game_name(i) not in NEEDS_NETWORK)


def check_env_id(env_id: str) -> None:
    """ValueError unless `env_id` is a single-player TextArena id that runs offline."""
    import_textarena(env_id)
    from textarena.envs.registration import ENV_REGISTRY

    catalog = _catalog()
    if env_id in catalog and _game_name(env_id) in NEEDS_NETWORK:
        games = sorted({_game_name(i) for i in offline_ids()})
        raise ValueError(f"{PREFIX}{env_id} needs the network at run time (TextArena "
                         "downloads word lists or asks an LLM judge); games that run "
                         f"offline: {', '.join(games)}")
    if env_id in catalog and not catalog[env_id]:
        raise ValueError(f"{PREFIX}{env_id}: the installed TextArena's source of this game "
                         "does not compile")
    if env_id in catalog:
        return
    if env_id in ENV_REGISTRY:
        raise ValueError(f"{PREFIX}{env_id} is neither a single-player nor a two-player "
                         f"game; {PREFIX} plays TextArena's one- and two-player games")
    by_lower = {i.lower(): i for i in catalog}
    close = [by_lower[m] for m in difflib.get_close_matches(env_id.lower(), by_lower, n=5,
                                                             cutoff=0.6)]
    hint = f"; close matches: {', '.join(close)}" if close else ""
    raise ValueError(f"unknown TextArena single-player id {env_id!r}{hint} "
                     "(jaxrl_agentic.envs.textarena_env.offline_ids() lists those that run)")


def _render(ta, state, messages) -> str:
    """New messages as `LLMObservationWrapper` renders them, without the action's echo."""
    lines = []
    for sender, message, kind in messages:
        # Countdown, Cryptarithm and Slitherlink (0.7.4) log the action with sender and
        # kind swapped: an echo either way.
        if ta.ObservationType.PLAYER_ACTION in (kind, sender):
            continue
        name = "GAME" if sender == ta.GAME_ID else state.role_mapping.get(sender,
                                                                           f"Player {sender}")
        lines.append(f"[{name}] {message}")
    return "\n".join(lines)


def _outcome(rewards, game_info) -> tuple[float, str | None]:
    """(reward, reason) of an ended game. Countdown, Cryptarithm and Slitherlink (TextArena
    0.7.4) call `set_invalid_move(progress, reason)`, arguments swapped: a game they end
    on an invalid move has the reason as its reward and "Invalid Move: <progress>" as its
    reason; the two are put back in place."""
    reward, reason = (rewards or {}).get(0, 0.0), game_info[0].get("reason")
    if isinstance(reward, str):
        try:
            reward, reason = float(str(reason).removeprefix("Invalid Move: ")), reward
        except ValueError:
            reward, reason = -1.0, reward  # set_invalid_move's default, an invalid loss
    return float(reward), reason


class TextArenaEnv(PythonTextEnv):
    """One episode of a TextArena single-player game; see the module docstring."""

    def __init__(self, env_id: str, *, format_penalty: float = 0.1,
                 max_steps_in_episode: int | None = None, reply_hint: str | None = None,
                 game_kwargs: dict | None = None):
        self.ta = import_textarena(env_id)
        self.env_id = env_id
        self.format_penalty = float(format_penalty)
        self.reply_hint = reply_hint
        self.game_kwargs = dict(game_kwargs or {})
        self.game = self.base = None  # made by reset(): the id's wrappers, the game under them
        self.max_steps_in_episode = int(max_steps_in_episode or DEFAULT_MAX_STEPS)
        self._rng: thread_random.States | None = None  # this episode's random states
        self._text: str | None = None
        self._done = False
        thread_random.install()

    def reset(self, seed: int) -> str:
        self._rng, self.game, self.base = new_game(self.ta, self.env_id, self.game_kwargs,
                                                   int(seed), 1)
        with thread_random.own_states(self._rng):
            _, messages = self.base.get_observation()
        self._done = False
        text = _render(self.ta, self.base.state, messages)
        if self.reply_hint:
            text = f"{text}\n{self.reply_hint}"
        self._text = text
        return text

    def step(self, reply: str) -> PyStep:
        if self._text is None:
            raise RuntimeError("step() before reset()")
        if self._done:
            raise RuntimeError("step() after the game ended")
        with thread_random.own_states(self._rng):
            done, _ = self.game.step(str(reply))
            _, messages = self.base.get_observation()
            done = bool(done)
            # (rewards, game_info); rewards is None until the game ends.
            rewards, game_info = self.game.close() if done else (None, None)
        state = self.base.state
        text = _render(self.ta, state, messages)
        if done:
            invalid = bool(game_info[0].get("invalid_move", False))
            reward, reason = _outcome(rewards, game_info)
            if reason:
                text = f"{text}\n[GAME] {reason}" if text else f"[GAME] {reason}"
        else:
            invalid = state.error_count > 0  # a forgiven invalid move
            reward = -self.format_penalty if invalid else 0.0
        self._done, self._text = done, text
        return PyStep(observation=text, reward=reward, terminated=done,
                      action_is_valid=not invalid, action_is_effective=not invalid,
                      success=done and not invalid and reward >= 1.0, action=INVALID_ACTION)

    def state_hash(self) -> bytes:
        if self._text is None:
            raise RuntimeError("state_hash() before reset()")
        return text_state_hash(self._text)


# A bracketed example action in a game's instructions: "[up]", "[5]", "[A C]", "[3 2]".
_EXAMPLE = re.compile(r"\[([^\[\]\n]{1,16})\]")


def random_example_policy(rng, **_unused):
    """The format warm-up's text policy (`warmup.py`) for any game: each reply is one of the
    bracketed example actions of the game's first message, drawn at random ([GAME] and
    [Player …] tags and lists such as a tower's "[3, 2, 1]" are not actions). It teaches
    the reply format, not the game."""
    examples: list[str] = []

    def reply(text: str) -> str:
        if not examples:
            found = [f"[{m}]" for m in _EXAMPLE.findall(text)
                     if m != "GAME" and not m.startswith("Player") and "," not in m]
            examples.extend(dict.fromkeys(found) or ["[0]"])
        return rng.choice(examples)

    return reply


def _limits_of(game) -> dict[str, Any]:
    from textarena.core import Wrapper
    from textarena.wrappers import ClipCharactersActionWrapper, ClipWordsActionWrapper

    state = unwrap(game).state
    limits = {"max_turns": getattr(state, "max_turns", None),
              "error_allowance": getattr(state, "error_allowance", None),
              "max_reply_chars": None, "max_reply_words": None}
    while isinstance(game, Wrapper):
        if isinstance(game, ClipCharactersActionWrapper):
            limits["max_reply_chars"] = game.max_num_characters
        if isinstance(game, ClipWordsActionWrapper):
            limits["max_reply_words"] = game.max_num_words
        game = game.env
    return limits


def _probe(env_id: str, game_kwargs: dict | None) -> TextArenaEnv:
    """A reset episode of `env_id`: a game that cannot start fails here, at config time."""
    check_env_id(env_id)
    try:
        env = TextArenaEnv(env_id, game_kwargs=game_kwargs)
        env.reset(0)
    except Exception as e:
        raise ValueError(f"{PREFIX}{env_id} does not start: {type(e).__name__}: {e}") from e
    return env


def textarena_limits(env_id: str, game_kwargs: dict | None = None) -> dict[str, Any]:
    """What the game states of its limits (None where it says nothing):

    max_turns: valid moves before the game ends; error_allowance: invalid moves in a row
    it forgives; max_reply_chars / max_reply_words: replies are clipped beyond these
    (TextArena's clip wrappers; none of its single-player ids has one).
    """
    return _limits_of(_probe(env_id, game_kwargs).game)


def textarena_builder(env_id: str, *, format_penalty: float = 0.1,
                      max_steps_in_episode: int | None = None, reply_hint: str | None = None,
                      game_kwargs: dict | None = None, **unknown: Any):
    """`make_python_env("textarena:<env_id>", **config)`: the episode factory (a two-player
    id's is `textarena_games.two_player_builder`'s, with its own config).

    format_penalty: the cost of an invalid move the game forgives (>= 0).
    max_steps_in_episode: replies before the runner ends the episode; default the most the
        game allows, max_turns * (1 + error_allowance), or DEFAULT_MAX_STEPS without a limit.
    reply_hint: a line added to the first message (the games state their own format).
    game_kwargs: the game's constructor arguments over the id's (e.g. max_turns).
    """
    import_textarena(env_id)
    from jaxrl_agentic.envs import textarena_games

    if textarena_games.is_two_player(env_id):  # seats, self-play: textarena_games.py
        return textarena_games.two_player_builder(
            env_id, format_penalty=format_penalty, max_steps_in_episode=max_steps_in_episode,
            reply_hint=reply_hint, game_kwargs=game_kwargs, **unknown)
    if unknown:
        raise ValueError(f"{PREFIX}{env_id}: unknown config {sorted(unknown)}; allowed: "
                         "format_penalty, max_steps_in_episode, reply_hint, game_kwargs")
    if not float(format_penalty) >= 0.0:
        raise ValueError(f"format_penalty must be >= 0, got {format_penalty}")
    if max_steps_in_episode is not None and (isinstance(max_steps_in_episode, bool) or int(
            max_steps_in_episode) != max_steps_in_episode or max_steps_in_episode < 1):
        raise ValueError(f"max_steps_in_episode must be an int >= 1, got "
                         f"{max_steps_in_episode!r}")
    if reply_hint is not None and (not isinstance(reply_hint, str) or "\n" in reply_hint):
        raise ValueError(f"reply_hint must be one line of text, got {reply_hint!r}")
    if game_kwargs is not None:
        try:  # a dict or a config's nested ConfigDict
            game_kwargs = {str(k): v for k, v in dict(game_kwargs).items()}
        except (TypeError, ValueError):
            raise ValueError(f"game_kwargs must be a dict, got {game_kwargs!r}") from None
    if max_steps_in_episode is None:
        limits = _limits_of(_probe(env_id, game_kwargs).game)
        max_steps_in_episode = DEFAULT_MAX_STEPS
        if limits["max_turns"]:
            max_steps_in_episode = limits["max_turns"] * (1 + (limits["error_allowance"] or 0))
    else:
        _probe(env_id, game_kwargs)
    options = dict(format_penalty=float(format_penalty),
                   max_steps_in_episode=int(max_steps_in_episode), reply_hint=reply_hint,
                   game_kwargs=dict(game_kwargs or {}))

    def factory(spec, run_seed: int) -> TextArenaEnv:
        del spec, run_seed  # the seed comes with reset(); it alone picks the game
        return TextArenaEnv(env_id, **options)

    return factory


register_prefix(PREFIX, textarena_builder)
