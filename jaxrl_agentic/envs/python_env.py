"""Host-side (non-JAX) text environments: one stateful Python object per episode.

An environment that calls a tool, a sandbox or a web service cannot be vmapped and jitted.
`PythonTextEnv` is the contract such an environment implements, and
`rollout/python_runner.py` plays it, each episode's calls on a worker thread with a deadline:

    env = factory(spec, run_seed)   # one instance per episode (spec: an EpisodeSpec)
    text = env.reset(spec.seed)     # first user message: instructions + first observation
    h = env.state_hash()            # bytes: hash of the state the next reply answers
    step = env.step(reply)          # -> PyStep
    ...
    frame = env.render_rgb()        # optional: [H, W, 3] uint8 for episode GIFs, or None
    reply = env.warmup_reply(rng)   # optional: a well-formed reply for the format warm-up

- `reply` is the raw decoded model reply (special tokens stripped); the environment parses
  it itself. `PyStep.action` is the parsed action id the turn records (`Turn.action`), or
  `INVALID_ACTION` (-1) when there is none or the environment has no action ids.
- `PyStep.observation` is the next user message (feedback on the reply + the new state); the
  runner sends it only if the episode goes on. A tool environment (`envs/tools.py`) sets
  `PyStep.tool_messages` instead: the results of the reply's tool calls, sent as `tool`
  messages; its class attribute-or-property `tool_schemas` (JSON schemas) is listed in the
  system prompt of the first message (None: no tools). `terminated` ends the episode; so does
  `max_steps_in_episode` steps (an attribute), counted like the JAX rollout does.
- `state_hash()` returns bytes equal exactly when two states are the same situation: it
  anchors GiGPO step groups across the episodes of a group, so it must be stable across
  processes (hashlib, not Python's salted `hash()`); see `text_state_hash`.
- `warmup_reply(rng)` (optional; `None`, the default, when the environment has none): a
  reply in the format the environment parses, to the state it is in, of no particular
  quality (a random valid move, say; `rng` is a `random.Random`). The format warm-up
  (`format_warmup.steps > 0`) writes it on every turn of its episodes when the environment
  has no built-in policy (`warmup.text_policy`) and no `format_warmup.replies` are given:
  the whole reply the environment reads, `reply_prefix` and `reply_suffix` included.
- One instance never sees two calls at once, but calls may come from different threads.
  A call that misses the runner's deadline is abandoned (its thread cannot be killed): the
  instance is never called again.

`JaxEnvAsPython` plays any registered JAX `TextEnvironment` through this contract with the
same messages, keys, rewards and flags as `RolloutRunner`, so the two runners can be checked
against each other; `step_delay_s` / `hang_on_step` stand in for a slow / hung tool call.

Registry: `make_python_env(name, **config)` returns a factory `(spec, run_seed) -> env`.
Every JAX environment name (`jaxrl_agentic.envs.make`'s, `gymnax:<id>` included) works through
the adapter, with config = `step_delay_s`, `hang_on_step` and the environment's own params. The tool
environments `calculator` and `lookup` build on this module and are registered by the
package (`jaxrl_agentic/envs/__init__.py`), so they are there whatever module is imported.
"""

from __future__ import annotations

import dataclasses
import hashlib
import random
import time
from collections.abc import Callable
from typing import Any, Protocol

import jax
import numpy as np

from jaxrl_agentic.envs.base import INVALID_ACTION
from jaxrl_agentic.envs.gymnax_adapter import PREFIX as GYMNAX_PREFIX
from jaxrl_agentic.envs.messages import feedback_message, first_message
from jaxrl_agentic.envs.registry import (
    make,
    register,
    registered_env,
    registered_envs,
    registered_prefix,
)


class EpisodeKey(Protocol):
    """What a factory reads of the episode it makes (``rollout.groups.EpisodeSpec`` is one;
    environments do not import the rollout layer above them)."""

    seed: int
    group_id: int
    member: int

# How long `hang_on_step` sleeps: "forever" for a test, finite so the thread ends one day.
HANG_SECONDS = 3600.0


@dataclasses.dataclass(frozen=True)
class PyStep:
    observation: str  # the next user message: feedback on the reply, then the new state
    reward: float
    terminated: bool  # the environment ended the episode
    action_is_valid: bool  # the reply held an action the environment accepted
    action_is_effective: bool  # the action changed the state
    success: bool  # the episode was solved by this step
    action: int = INVALID_ACTION  # parsed action id recorded in the Turn, -1 if none/unknown
    # Tool environments (`envs/tools.py`): when non-empty, the next messages are these tool
    # results (the chat's `tool` role, one per call) instead of `observation`.
    tool_messages: tuple[str, ...] = ()
    tool_calls: int = 0  # tool calls in the reply, garbled ones included
    tool_errors: int = 0  # garbled calls (bad JSON, unknown tool, bad arguments, timeout, ...)
    tool_timeouts: int = 0  # calls that missed their timeout (also counted in tool_errors)
    tool_error_kinds: tuple[str, ...] = ()  # the kind of each erroneous call (ERROR_KINDS)


class PythonTextEnv:
    """Base class of a stateful host-side text environment; see the module docstring."""

    max_steps_in_episode: int = 100
    tool_schemas: list | None = None  # tools the chat template lists (envs/tools.py)
    # Optional: a method `warmup_reply(self, rng: random.Random) -> str`, the format
    # warm-up's reply to the current state (module docstring); None: no policy of its own.
    warmup_reply: Callable[[random.Random], str] | None = None

    def reset(self, seed: int) -> str:
        """Starts the episode of map `seed`; returns the first user message."""
        raise NotImplementedError(f"{type(self).__name__} must implement reset()")

    def step(self, reply: str) -> PyStep:
        """Applies the model's raw reply; returns the outcome and the next user message."""
        raise NotImplementedError(f"{type(self).__name__} must implement step()")

    def state_hash(self) -> bytes:
        """Process-stable bytes identifying the current state (GiGPO anchor)."""
        raise NotImplementedError(f"{type(self).__name__} must implement state_hash()")

    def render_rgb(self) -> np.ndarray | None:
        """The current state as an [H, W, 3] uint8 image for the run's episode GIFs, or
        None (the default) when the environment has no picture: the run then logs once
        that it skips the GIFs and counts the skips in `render/skipped`."""
        return None


PythonEnvFactory = Callable[[EpisodeKey, int], PythonTextEnv]
FactoryBuilder = Callable[..., PythonEnvFactory]


def text_state_hash(text: str) -> bytes:
    """16-byte digest of a text rendering of a state (stable across processes)."""
    return hashlib.blake2b(text.encode("utf-8"), digest_size=16).digest()


# ---- the JAX adapter ------------------------------------------------------------------------


class JaxEnvAsPython(PythonTextEnv):
    """One episode of a JAX `TextEnvironment`, keyed exactly as `RolloutRunner` keys it:

        map_key   = fold_in(PRNGKey(run_seed), seed)     # reset: the map
        noise_key = fold_in(map_key, 1 + member)         # members share the map, not the noise
        step t    = step_env(fold_in(noise_key, t), state, parse_action(reply) or -1, params)

    Messages are `envs/messages.py`'s `first_message` / `feedback_message`.
    """

    def __init__(self, env, params, *, member: int, run_seed: int, step_delay_s: float = 0.0,
                 hang_on_step: int = -1, _compiled=None):
        self.env, self.params = env, params
        self.member, self.run_seed = int(member), int(run_seed)
        self.step_delay_s, self.hang_on_step = float(step_delay_s), int(hang_on_step)
        self.max_steps_in_episode = int(params.max_steps_in_episode)
        self._reset, self._step = _compiled or _compile(env)
        self._state = None
        self._noise_key = None
        self._steps = 0

    def reset(self, seed: int) -> str:
        map_key = jax.random.fold_in(jax.random.PRNGKey(self.run_seed), seed)
        self._noise_key = jax.random.fold_in(map_key, 1 + self.member)
        _, state = self._reset(map_key, self.params)
        self._state = jax.device_get(state)
        self._steps = 0
        return first_message(self.env, self._state, self.params)

    def step(self, reply: str) -> PyStep:
        if self._state is None:
            raise RuntimeError("step() before reset()")
        if self._steps == self.hang_on_step:
            time.sleep(HANG_SECONDS)
        if self.step_delay_s > 0:
            time.sleep(self.step_delay_s)
        parsed = self.env.parse_action(reply)
        action = INVALID_ACTION if parsed is None else int(parsed)
        key = jax.random.fold_in(self._noise_key, self._steps)
        _, state, reward, terminated, info = self._step(key, self._state, action, self.params)
        state, reward, terminated, info = jax.device_get((state, reward, terminated, info))
        self._state, self._steps = state, self._steps + 1
        return PyStep(
            observation=feedback_message(self.env, state, self.params, float(reward), action),
            reward=float(reward),
            terminated=bool(terminated),
            action_is_valid=bool(info["action_is_valid"]),
            action_is_effective=bool(info["action_is_effective"]),
            success=bool(info["success"]),
            action=action,
        )

    def state_hash(self) -> bytes:
        if self._state is None:
            raise RuntimeError("state_hash() before reset()")
        return self.env.state_hash(self._state)

    def render_rgb(self) -> np.ndarray:
        if self._state is None:
            raise RuntimeError("render_rgb() before reset()")
        return self.env.render_rgb(self._state, self.params)

    def warmup_reply(self, rng: random.Random) -> str:
        """A uniformly random valid action, as the JAX warm-up writes it
        (`warmup.random_action_replies`)."""
        return f"<answer>{rng.choice(self.env.action_names)}</answer>"


def _compile(env):
    return jax.jit(env.reset_env), jax.jit(env.step_env)


def jax_env_factory(env_type: str, *, step_delay_s: float = 0.0, hang_on_step: int = -1,
                    **env_config: Any) -> PythonEnvFactory:
    """Factory of `JaxEnvAsPython` episodes of `make(env_type, **env_config)`.

    The environment is built and its reset/step jitted once here, shared by all episodes.
    """
    if not float(step_delay_s) >= 0.0:
        raise ValueError(f"step_delay_s must be >= 0, got {step_delay_s}")
    if isinstance(hang_on_step, bool) or not isinstance(hang_on_step, int):
        raise ValueError(f"hang_on_step must be an int (-1 = never), got {hang_on_step!r}")
    env, params = make(env_type, **env_config)
    compiled = _compile(env)

    def factory(spec: EpisodeKey, run_seed: int) -> JaxEnvAsPython:
        return JaxEnvAsPython(env, params, member=spec.member, run_seed=run_seed,
                              step_delay_s=step_delay_s, hang_on_step=hang_on_step,
                              _compiled=compiled)

    return factory


# ---- registry (the one of envs/registry.py, on the "python" backend) -------------------------


def register_python_env(name: str, factory_builder: FactoryBuilder) -> None:
    """Make `make_python_env(name, **config)` return `factory_builder(**config)`:
    `register(name, factory_builder, backend="python")`."""
    if not isinstance(name, str) or not name:
        raise ValueError("python environment name must be a non-empty str")
    if not callable(factory_builder):
        raise TypeError(f"factory_builder for {name!r} must be callable, "
                        f"got {type(factory_builder).__name__}")
    register(name, factory_builder, backend="python")


def registered_python_envs() -> list[str]:
    """Names the Python backend plays, sorted: the Python environments and, through the
    adapter, every JAX one."""
    return registered_envs()


def make_python_env(name: str, **config: Any) -> PythonEnvFactory:
    """The episode factory `(spec, run_seed) -> PythonTextEnv` for `name` with `config`."""
    entry = registered_env(name)
    if entry is not None and entry.backend == "python":
        return entry.factory(**config)
    family = registered_prefix(name)
    if family is not None:  # `textarena:<id>` and such: the family's builder knows its ids
        env_id, registration = family
        return registration.factory(env_id, **config)
    if name.startswith(GYMNAX_PREFIX) or entry is not None:
        return jax_env_factory(name, **config)
    raise ValueError(
        f"unknown python environment {name!r}; registered: "
        f"{', '.join(registered_python_envs())}; or any JAX environment name "
        f"(jaxrl_agentic.envs.registered_envs() or {GYMNAX_PREFIX}<id>)"
    )
