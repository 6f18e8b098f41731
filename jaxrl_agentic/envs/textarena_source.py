"""What both TextArena adapters read from the installed package: the package itself (one
clear error without it), a game module's source text without importing it, a new seeded
game and the game under TextArena's wrappers (`textarena_env.py`: single-player games;
`textarena_games.py`: two-player ones)."""

from __future__ import annotations

import inspect
import os

from jaxrl_agentic.envs import thread_random

PREFIX = "textarena:"


def import_textarena(env_id: str):
    try:
        import textarena
    except ImportError as e:
        raise ImportError(f"{PREFIX}{env_id} needs the textarena package: "
                          "pip install -e '.[envs]'") from e
    return textarena


def entry_source(ta, entry_point) -> str:
    """Source text of an id's game module, read without importing it (TextArena 0.7.4 ships
    modules that do not import, e.g. Klondike's); "" if not found."""
    if not isinstance(entry_point, str):
        try:
            return inspect.getsource(inspect.getmodule(entry_point))
        except (OSError, TypeError):
            return ""
    parts = entry_point.split(":")[0].split(".")
    if parts[0] != "textarena":
        return ""
    path = os.path.join(os.path.dirname(ta.__file__), *parts[1:])
    for candidate in (path + ".py", os.path.join(path, "__init__.py")):
        if os.path.isfile(candidate):
            with open(candidate, encoding="utf-8") as f:
                return f.read()
    return ""


def new_game(ta, env_id: str, game_kwargs: dict, seed: int, num_players: int):
    """(random states, game, the game under its wrappers): game ``seed`` of ``env_id``, made
    and reset under its own random states (``thread_random``). Made here, seeded: some
    games draw from ``random`` in their constructor."""
    rng = thread_random.States(seed)
    with thread_random.own_states(rng):
        game = ta.make(env_id, **game_kwargs)
        game.reset(num_players=num_players, seed=seed)
    return rng, game, unwrap(game)


def unwrap(game):
    """The game under TextArena's wrappers (observations are read from it directly)."""
    from textarena.core import Wrapper

    while isinstance(game, Wrapper):
        game = game.env
    return game
