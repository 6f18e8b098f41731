"""Names -> environments: `make(name, **overrides)` and `register(name, factory, **preset)`.

A factory is a zero-argument callable returning a `TextEnvironment`. `make` builds the
environment, starts from its `default_params`, applies the preset registered with the name,
then the caller's keyword overrides (each must name a params field), and checks the result:

    env, env_params = make("sokoban", dim_room=8, num_boxes=2)

Names starting with `gymnax:` wrap gymnax's own registry (`make("gymnax:CartPole-v1")`).
"""

from collections.abc import Callable
from typing import Any

from jaxrl_agentic.envs.base import TextEnvironment, TextEnvParams
from jaxrl_agentic.envs.frozen_lake import FrozenLake
from jaxrl_agentic.envs.gymnax_adapter import PREFIX, GymnaxTextAdapter
from jaxrl_agentic.envs.sokoban import Sokoban

EnvFactory = Callable[[], TextEnvironment]

_REGISTRY: dict[str, tuple[EnvFactory, dict[str, Any]]] = {}


def register(name: str, factory: EnvFactory, **preset: Any) -> None:
    """Make `name` build `factory()` with params fields `preset` set (before user overrides)."""
    if not isinstance(name, str) or not name or name.startswith(PREFIX):
        raise ValueError(f"environment name must be a non-empty str not starting {PREFIX!r}")
    if not callable(factory):
        raise TypeError(f"factory for {name!r} must be callable, got {type(factory).__name__}")
    if name in _REGISTRY:
        raise ValueError(f"environment {name!r} is already registered")
    _REGISTRY[name] = (factory, dict(preset))


def registered_envs() -> list[str]:
    """Registered names, sorted (gymnax ids are reachable as `gymnax:<id>` besides these)."""
    return sorted(_REGISTRY)


def make(name: str, **overrides: Any) -> tuple[TextEnvironment, TextEnvParams]:
    """(env, params) for a registered name or `gymnax:<id>`; see the module docstring."""
    if name.startswith(PREFIX):
        env, preset = GymnaxTextAdapter(name[len(PREFIX) :]), {}
    elif name in _REGISTRY:
        factory, preset = _REGISTRY[name]
        env = factory()
    else:
        raise ValueError(
            f"unknown environment {name!r}; registered: {', '.join(registered_envs())}; "
            f"or {PREFIX}<id> for a gymnax environment"
        )
    params = env.replace_params(env.default_params, **{**preset, **overrides})
    env.check_params(params)
    return env, params


register("frozen_lake", FrozenLake)
register("frozen_lake_slippery", FrozenLake, is_slippery=True)
register("sokoban", Sokoban)
register("sokoban_large", Sokoban, dim_room=8, num_boxes=2)
