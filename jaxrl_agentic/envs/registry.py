"""Names -> environments: one registry for JAX and host-side (Python) environments.

    register(name, factory, backend="jax", **preset)      # a gymnax-API TextEnvironment
    register(name, factory_builder, backend="python")     # a PythonTextEnv per episode

A JAX factory is a zero-argument callable returning a `TextEnvironment`. `make` builds the
environment, starts from its `default_params`, applies the preset registered with the name,
then the caller's keyword overrides (each must name a params field), and checks the result:

    env, env_params = make("sokoban", dim_room=8, num_boxes=2)

A Python factory builder is `factory_builder(**config) -> (spec, run_seed) -> PythonTextEnv`
(`envs/python_env.py`, `make_python_env`). Each environment declares its backend; a run's
`env_backend="auto"` takes it, and `"python"` also plays a JAX environment through the
adapter (`JaxEnvAsPython`). Names starting with `gymnax:` wrap gymnax's own registry
(`make("gymnax:CartPole-v1")`), on the JAX backend.

Families of environments another library names (`textarena:<EnvId>`,
`reasoning_gym:<dataset>`) register a prefix instead of each name:

    register_prefix("textarena:", builder, backend="python")   # builder(env_id, **config)

`make_python_env("textarena:FrozenLake-v0", **config)` then calls the builder with the id;
whether the id exists is the builder's to say (its library knows).
"""

import dataclasses
from collections.abc import Callable
from typing import Any

from jaxrl_agentic.envs.base import TextEnvironment, TextEnvParams
from jaxrl_agentic.envs.frozen_lake import FrozenLake
from jaxrl_agentic.envs.gymnax_adapter import PREFIX, GymnaxTextAdapter
from jaxrl_agentic.envs.sokoban import Sokoban
from jaxrl_agentic.registration import same_registration

EnvFactory = Callable[[], TextEnvironment]
BACKENDS = ("jax", "python")


@dataclasses.dataclass(frozen=True)
class RegisteredEnv:
    backend: str
    factory: Callable
    preset: dict


_REGISTRY: dict[str, RegisteredEnv] = {}
_PREFIXES: dict[str, RegisteredEnv] = {}


def register_prefix(prefix: str, builder: Callable, *, backend: str = "python",
                    replace: bool = False) -> None:
    """Names ``prefix + <id>`` build ``builder(<id>, **config)`` (module doc); Python
    backend only (a JAX family registers its names)."""
    if not prefix.endswith(":") or prefix == PREFIX:
        raise ValueError(f"prefix {prefix!r} must end with ':' and not be {PREFIX!r}")
    if backend != "python":
        raise ValueError(f"prefix {prefix!r}: only Python environment families take a prefix")
    entry = RegisteredEnv(backend, builder, {})
    if prefix in _PREFIXES and not replace:
        if same_registration(_PREFIXES[prefix], entry):
            return  # the same builder again (registration.py: a module run twice)
        raise ValueError(f"environment prefix {prefix!r} is already registered")
    _PREFIXES[prefix] = entry


def registered_prefix(name: str) -> tuple[str, RegisteredEnv] | None:
    """(the id after the prefix, the family's registration) for ``prefix:<id>`` names."""
    for prefix, entry in _PREFIXES.items():
        if name.startswith(prefix):
            return name[len(prefix):], entry
    return None


def register(name: str, factory: Callable, *, backend: str = "jax", replace: bool = False,
             **preset: Any) -> None:
    """Make `name` build `factory` on `backend` (module doc); `preset` (JAX only): params
    fields set before user overrides. Registering a name again with the same factory and
    settings (a recipe file read twice: `registration.same_registration`) changes nothing;
    another registration of it is an error unless `replace`."""
    if not isinstance(name, str) or not name or name.startswith(PREFIX):
        raise ValueError(f"environment name must be a non-empty str not starting {PREFIX!r}")
    if backend not in BACKENDS:
        raise ValueError(f"environment {name!r}: backend must be one of {BACKENDS}, "
                         f"got {backend!r}")
    if not callable(factory):
        raise TypeError(f"factory for {name!r} must be callable, got {type(factory).__name__}")
    if preset and backend != "jax":
        raise ValueError(f"environment {name!r}: presets are params fields of a JAX env")
    entry = RegisteredEnv(backend, factory, dict(preset))
    if name in _REGISTRY and not replace:
        if same_registration(_REGISTRY[name], entry):
            return
        raise ValueError(f"environment {name!r} is already registered")
    _REGISTRY[name] = entry


def registered_envs(backend: str | None = None) -> list[str]:
    """Registered names, sorted: all, or those declared on `backend` (gymnax ids are
    reachable as `gymnax:<id>` besides these)."""
    return sorted(n for n, e in _REGISTRY.items() if backend in (None, e.backend))


def registered_env(name: str) -> RegisteredEnv | None:
    """The registration of `name` (None for `gymnax:<id>` and unknown names)."""
    return _REGISTRY.get(name)


def declared_backend(name: str) -> str:
    """The backend `name` was registered on ("jax" for `gymnax:<id>`)."""
    if name.startswith(PREFIX):
        return "jax"
    family = registered_prefix(name)
    if family is not None:
        return family[1].backend
    if name not in _REGISTRY:
        prefixes = "".join(f", {p}<id>" for p in sorted(_PREFIXES))
        raise ValueError(f"unknown environment {name!r}; registered: "
                         f"{', '.join(registered_envs())}; or {PREFIX}<id> for a gymnax "
                         f"environment{prefixes}")
    return _REGISTRY[name].backend


def resolve_backend(name: str, requested: str = "auto") -> str:
    """The backend a run plays `name` on: its declared one for "auto"; "python" also plays a
    JAX environment (through the adapter); a Python environment has no JAX form."""
    declared = declared_backend(name)
    if requested == "auto":
        return declared
    if requested not in BACKENDS:
        raise ValueError(f"{requested!r} is not allowed; allowed: auto, {', '.join(BACKENDS)}")
    if requested == "jax" and declared == "python":
        raise ValueError(f"{name!r} is a Python environment; use env_backend 'python' or "
                         "'auto'")
    return requested


def make(name: str, **overrides: Any) -> tuple[TextEnvironment, TextEnvParams]:
    """(env, params) for a registered JAX name or `gymnax:<id>`; see the module docstring."""
    if name.startswith(PREFIX):
        env, preset = GymnaxTextAdapter(name[len(PREFIX) :]), {}
    elif name in _REGISTRY and _REGISTRY[name].backend == "jax":
        entry = _REGISTRY[name]
        env, preset = entry.factory(), entry.preset
    elif name in _REGISTRY:
        raise ValueError(f"{name!r} is a Python environment: make_python_env({name!r}) "
                         "builds its episodes")
    else:
        raise ValueError(
            f"unknown environment {name!r}; registered: {', '.join(registered_envs('jax'))}; "
            f"or {PREFIX}<id> for a gymnax environment"
        )
    params = env.replace_params(env.default_params, **{**preset, **overrides})
    env.check_params(params)
    return env, params


register("frozen_lake", FrozenLake)
register("frozen_lake_slippery", FrozenLake, is_slippery=True)
register("sokoban", Sokoban)
register("sokoban_large", Sokoban, dim_room=8, num_boxes=2)
