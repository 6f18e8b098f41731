"""Per-episode metrics from the per-turn record a rollout keeps (pure numpy)."""

from collections.abc import Mapping, Sequence
from typing import Any

import numpy as np

INFO_KEYS = ("action_is_valid", "action_is_effective", "success")


def _stack_infos(infos: Sequence[Mapping[str, Any]] | Mapping[str, Any], key: str) -> np.ndarray:
    if isinstance(infos, Mapping):
        return np.asarray(infos[key], bool).reshape(-1)
    return np.asarray([bool(np.asarray(info[key])) for info in infos], bool)


def episode_metrics(
    rewards: Sequence[float] | np.ndarray,
    infos: Sequence[Mapping[str, Any]] | Mapping[str, Any],
) -> dict[str, float]:
    """Metrics of one episode of T turns.

    rewards: the T step rewards. infos: the T `info` dicts returned by `step` (or one dict
    of length-T arrays), each with `action_is_valid`, `action_is_effective`, `success`.

        success             1.0 if some turn solved the episode, else 0.0
        return              sum of the rewards (format penalties included)
        num_actions         T, the number of replies the environment was stepped with
        action_is_valid     fraction of turns whose reply held a valid action
        action_is_effective fraction of turns whose action changed the state
    The two rates are 0.0 for an episode without turns.
    """
    rewards = np.asarray(rewards, np.float64).reshape(-1)
    flags = {key: _stack_infos(infos, key) for key in INFO_KEYS}
    for key, values in flags.items():
        if len(values) != len(rewards):
            raise ValueError(f"{len(rewards)} rewards but {len(values)} values of {key!r}")
    turns = len(rewards)
    return {
        "success": float(flags["success"].any()),
        "return": float(rewards.sum()),
        "num_actions": float(turns),
        "action_is_valid": float(flags["action_is_valid"].mean()) if turns else 0.0,
        "action_is_effective": float(flags["action_is_effective"].mean()) if turns else 0.0,
    }
