"""Settings a recipe tuned for its own environment, and what another environment gets.

A recipe tuned for one game or dataset carries settings that only fit it: the game's
constructor arguments, the dataset's parameters, a reply budget or warm-up replies cut to
its moves. `--config.env_id=<another id>` must not inherit them (another game refuses the
arguments: `unexpected keyword argument 'steps'`). The recipe marks them, each with the
value that any other environment on that tag takes:

    c.custom_envs = {"game": env_spec("textarena:ThreeCardMonte-v0", max_tokens_per_step=1,
                                      game_kwargs={"steps": 0})}
    env_specific_settings(c, "game", {"custom_envs.game.env_config.game_kwargs": {},
                                      "custom_envs.game.max_tokens_per_step": 8})

The fields keep their tuned values, so the recipe run as it is reads what it wrote, and an
override of one works as on any field. `c.env_specific.<tag>` records the environment they
were tuned for and, per field, its tuned value and its value elsewhere.
`resolve_env_specific(c)` is the config a run plays: where the tag plays another
environment (`env_id`, or another `custom_envs.<tag>.env_type`), each marked field that
still holds its tuned value takes its value elsewhere, and a field the run's overrides
changed keeps the override. `config.validate` and `run_config.build_run_config` both read
the resolved config.
"""

from __future__ import annotations

import copy
from collections.abc import Mapping
from typing import Any


def env_specific_settings(c, tag: str, elsewhere: Mapping[str, Any]) -> None:
    """Marks the fields named in `elsewhere` (dotted paths of `c`) as tuned for the
    environment `custom_envs[tag]` plays now; on any other environment there, each takes
    its value in `elsewhere` (module doc). Raises ValueError for a path `c` does not have."""
    if tag not in c.custom_envs:
        raise ValueError(f"env_specific_settings: {tag!r} is not in custom_envs "
                         f"({', '.join(c.custom_envs.keys())})")
    settings = []
    for path, value in elsewhere.items():
        try:
            tuned = _get(c, path)
        except (KeyError, AttributeError, TypeError):
            raise ValueError(f"env_specific_settings: config.{path} is not a field of the "
                             "recipe") from None
        settings.append((path, _plain(tuned), _plain(value)))
    c.env_specific[tag] = {"env_type": c.custom_envs[tag].env_type,
                           "settings": tuple(settings)}


def resolve_env_specific(c):
    """`c` as the run plays it (module doc): `c` itself when no marked field changes, else
    a copy with those fields at their values elsewhere."""
    changes = []
    for tag, entry in c.get("env_specific", {}).items():
        spec = c.custom_envs.get(tag)
        plays = c.get("env_id") or (spec.env_type if spec is not None else None)
        if plays == entry.env_type:
            continue
        for path, tuned, elsewhere in entry.settings:
            try:
                current = _get(c, path)
            except (KeyError, AttributeError, TypeError):
                continue  # gone with the tag a recipe built on this one replaced
            if _plain(current) == _plain(tuned):  # tuned: a list once read from config.json
                changes.append((path, elsewhere))
    if not changes:
        return c
    resolved = copy.deepcopy(c)
    with resolved.unlocked():
        for path, value in changes:
            *parents, last = path.split(".")
            node = resolved
            for part in parents:
                node = node[part]
            node[last] = copy.deepcopy(value)
    return resolved


def _get(c, path: str):
    for part in path.split("."):
        c = c[part]
    return c


def _plain(value):
    """A value in a form that compares as the field reads: dicts for config dicts, tuples
    for lists (an override's `[…]` and a recipe's `(…)` are the same setting)."""
    if hasattr(value, "to_dict"):
        value = value.to_dict()
    if isinstance(value, Mapping):
        return {k: _plain(v) for k, v in value.items()}
    if isinstance(value, list | tuple):
        return tuple(_plain(v) for v in value)
    return value
