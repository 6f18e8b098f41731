"""Agents written elsewhere as an environment type: `openai_agent`.

Most agents people want to train are programs written against the OpenAI chat API (with
tools in OpenAI's function-calling format). Such a program *is* the environment of its
episode: it sends the chat, reads the replies, calls its own tools, and knows how well it
did. An episode of `openai_agent` runs it, pointed at an OpenAI-compatible endpoint the
trainer serves from its own policy (`jaxrl_agentic/serving/`), and the number it returns is
the episode's reward:

    agent_fn(base_url: str, api_key: str, task) -> float | dict   # e.g. "my_agents:solve"

    custom_envs.<tag>.env_type = "openai_agent"
    custom_envs.<tag>.env_config = {"agent_fn": "my_agents:solve", "tasks": [...]}
    # or, the agent named in the type:  env_type = "agent:my_agents:solve"

env_config:

- ``agent_fn``: a ``"module:function"`` or ``"file.py:function"`` path (or the callable
  itself) called on an agent thread per episode (an ``async def`` runs in an event loop of
  that thread's own); it returns the reward, or a dict that adds ``success``,
  ``turn_rewards`` and ``metrics`` (`agent_outcome`). Or ``agent_command``: a program (a
  string split like a shell command, or a list) run per episode with ``OPENAI_BASE_URL``,
  ``OPENAI_API_KEY`` and ``AGENT_TASK`` (the task as JSON) in its environment, whose last
  line of output is the reward. Exactly one of the two.
- ``tasks``: a list, or the path of a ``.jsonl`` file (a task a line); episode seed s
  plays ``tasks[(s // 2) % len(tasks)]``: training seeds are even, 2·(cursor + group),
  validation's odd, 2·group + 1 (`rollout/groups.py`), so both walk the list in order (a
  validation manager's ``env_config`` may give it a list of its own: held-out tasks). Or
  ``task_fn``: a ``"module:function"`` path, ``task_fn(seed) -> task``. Without either,
  the task is the seed. Members of a group share their seed, hence their task: GRPO
  compares attempts at the same task.
- ``agent_timeout_s`` (default 600): an agent still running then is abandoned (its thread
  cannot be killed); its episode gets reward 0 and counts in ``agent/timeouts``.

An `OutsideAgentEpisode` holds what one episode runs; it is not stepped like the other
Python environments (its `reset` and `step` say so): `serving.AgentRolloutRunner` plays it.
"""

from __future__ import annotations

import asyncio
import hashlib
import importlib
import importlib.util
import inspect
import json
import math
import os
import shlex
import subprocess
import sys
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

from jaxrl_agentic.envs.python_env import PythonTextEnv

ENV_TYPE = "openai_agent"
# `agent:<module>:<function>` (or `agent:<file.py>:<function>`): the same, the agent named
# in the env type instead of `env_config.agent_fn`.
PREFIX = "agent:"
DEFAULT_AGENT_TIMEOUT_S = 600.0
# The runner that plays these episodes, named (it lives above this layer).
RUNNER = "jaxrl_agentic.serving.agent_runner:agent_rollout_runner"

# agent_fn(base_url, api_key, task) -> float | dict (`agent_outcome`), or a coroutine of one
AgentFn = Callable[[str, str, Any], Any]


def load_callable(path: str | Callable, field: str) -> Callable:
    """The callable `path` names: ``"package.module:function"`` (attributes dotted after the
    colon) or ``"path/to/file.py:function"`` (a file outside any package, loaded as a module
    of its own: agents usually live beside the user's code, not in an installed package);
    `path` itself when it is callable; a ValueError naming `field` otherwise."""
    if callable(path):
        return path
    if not isinstance(path, str) or path.count(":") != 1:
        raise ValueError(f"{field}: must be 'module:function' or 'file.py:function', got "
                         f"{path!r}")
    module_name, attr = path.split(":")
    try:
        obj = (_module_from_file(module_name) if module_name.endswith(".py")
               else importlib.import_module(module_name))
    except (ImportError, OSError) as e:
        raise ValueError(f"{field}: cannot import module {module_name!r} ({e})") from None
    for part in attr.split("."):
        if not hasattr(obj, part):
            raise ValueError(f"{field}: module {module_name!r} has no {attr!r}")
        obj = getattr(obj, part)
    if not callable(obj):
        raise ValueError(f"{field}: {path!r} is not callable")
    return obj


def _module_from_file(path: str):
    """The module of the Python file `path`, loaded once per absolute path (a second
    `load_callable` of the same file gets the same module, its globals shared)."""
    path = os.path.abspath(os.path.expanduser(path))
    if not os.path.isfile(path):
        raise ImportError(f"no such file: {path}")
    name = "_jaxrl_agentic_user_" + hashlib.sha1(path.encode()).hexdigest()[:12]
    if name not in sys.modules:
        spec = importlib.util.spec_from_file_location(name, path)
        module = importlib.util.module_from_spec(spec)
        sys.modules[name] = module
        try:
            spec.loader.exec_module(module)
        except BaseException:
            del sys.modules[name]
            raise
    return sys.modules[name]


def command_agent(command: str | Sequence[str], timeout_s: float) -> AgentFn:
    """An agent function that runs `command` (module doc) and reads its reward."""
    argv = shlex.split(command) if isinstance(command, str) else [str(a) for a in command]
    if not argv:
        raise ValueError("agent_command: must name a program")

    def run(base_url: str, api_key: str, task) -> float:
        env = dict(os.environ, OPENAI_BASE_URL=base_url, OPENAI_API_KEY=api_key,
                   AGENT_TASK=json.dumps(task))
        proc = subprocess.run(argv, env=env, capture_output=True, text=True,
                              timeout=timeout_s or None, check=False)
        if proc.returncode != 0:
            raise RuntimeError(f"agent command exited with {proc.returncode}: "
                               f"{proc.stderr.strip()[-300:]}")
        lines = proc.stdout.strip().splitlines()
        if not lines:
            raise RuntimeError("agent command printed nothing (its last line is the reward)")
        return float(lines[-1])

    return run


def checked_reward(value, what: str = "reward") -> float:
    """`value` as a finite float; a ValueError (bool, non-number, NaN, inf) otherwise."""
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise ValueError(f"the agent returned {type(value).__name__} {value!r:.60} as its "
                         f"{what}, not a number")
    if not math.isfinite(value):
        raise ValueError(f"the agent returned a non-finite {what} {value!r}")
    return float(value)


@dataclass(frozen=True)
class AgentOutcome:
    """What an agent's return value says of its episode (`agent_outcome`)."""

    reward: float
    success: bool | None = None  # None: reward > 0
    turn_rewards: tuple[float, ...] | None = None  # one per reply, in the order requested
    metrics: dict[str, float] = field(default_factory=dict)


OUTCOME_KEYS = ("reward", "success", "turn_rewards", "metrics")


def agent_outcome(value) -> AgentOutcome:
    """An agent's return value checked: a finite number (the reward), or a dict with
    ``reward`` and optionally ``success`` (bool; default reward > 0), ``turn_rewards`` (a
    finite number per reply of the episode, in the order the requests were answered, each
    added to its turn; ``reward`` still lands on the last) and ``metrics`` ({name: finite
    number}, logged per step as the mean over the episodes that report it,
    ``env/agent_metric/<name>``). Anything else is a ValueError saying what is wrong."""
    if not isinstance(value, dict):
        return AgentOutcome(checked_reward(value))
    unknown = sorted(set(map(str, value)) - set(OUTCOME_KEYS))
    if unknown or "reward" not in value:
        raise ValueError(f"the agent returned a dict with keys {sorted(map(str, value))}; "
                         f"it needs 'reward' and may have {', '.join(OUTCOME_KEYS[1:])}")
    success = value.get("success")
    if success is not None and not isinstance(success, bool):
        raise ValueError(f"the agent returned success={success!r:.40}, not a bool")
    turns = value.get("turn_rewards")
    if turns is not None:
        if isinstance(turns, (str, bytes)) or not isinstance(turns, Sequence):
            raise ValueError(f"the agent returned turn_rewards={turns!r:.60}, not a list")
        turns = tuple(checked_reward(r, "turn reward") for r in turns)
    metrics = value.get("metrics") or {}
    if not isinstance(metrics, dict):
        raise ValueError(f"the agent returned metrics={metrics!r:.60}, not a dict")
    return AgentOutcome(checked_reward(value["reward"]), success, turns,
                        {str(k): checked_reward(v, f"metric {k!r}") for k, v in metrics.items()})


def run_agent(agent: Callable, base_url: str, api_key: str, task) -> AgentOutcome:
    """One episode of `agent` on the calling thread: a coroutine function (``async def``)
    or a function returning an awaitable is run to completion in an event loop of this
    thread's own; the result checked (`agent_outcome`)."""
    value = agent(base_url, api_key, task)
    if inspect.isawaitable(value):
        value = asyncio.run(_awaited(value))
    return agent_outcome(value)


async def _awaited(awaitable):
    return await awaitable


class OutsideAgentEpisode(PythonTextEnv):
    """One episode of an outside agent: its task and the function that plays it."""

    def __init__(self, agent: AgentFn, task: Any, timeout_s: float):
        self.agent, self.task, self.timeout_s = agent, task, float(timeout_s)

    def reset(self, seed: int) -> str:
        raise RuntimeError(f"{ENV_TYPE} episodes are played by the agent through the "
                           "OpenAI-compatible endpoint (jaxrl_agentic.serving), not stepped")

    step = reset

    def state_hash(self) -> bytes:
        return b""


def read_jsonl_tasks(path: str) -> list:
    """The tasks of a JSON Lines file, one JSON value a line (blank lines skipped); a
    ValueError naming the file and line for a missing file or a line that is not JSON."""
    try:
        with open(os.path.expanduser(path), encoding="utf-8") as f:
            lines = f.read().splitlines()
    except OSError as e:
        raise ValueError(f"tasks: cannot read {path!r} ({e.strerror})") from None
    tasks = []
    for n, line in enumerate(lines, 1):
        if line.strip():
            try:
                tasks.append(json.loads(line))
            except json.JSONDecodeError as e:
                raise ValueError(f"tasks: {path}:{n} is not JSON ({e.msg})") from None
    return tasks


def outside_agent_factory(*, agent_fn: str | Callable | None = None,
                          agent_command: str | Sequence[str] | None = None,
                          tasks: Sequence[Any] | None = None,
                          task_fn: str | Callable | None = None,
                          agent_timeout_s: float = DEFAULT_AGENT_TIMEOUT_S,
                          format_penalty: float = 0.0):
    """The episode factory `(spec, run_seed) -> OutsideAgentEpisode` of env_config (module
    doc). `format_penalty` is taken and unused: the agent's reward is the reward."""
    del format_penalty
    if (agent_fn is None) == (agent_command is None):
        raise ValueError("agent_fn / agent_command: give exactly one (the agent to run)")
    if not float(agent_timeout_s) >= 0.0:
        raise ValueError(f"agent_timeout_s: must be >= 0 (0 = no limit), got "
                         f"{agent_timeout_s!r}")
    agent = (load_callable(agent_fn, "agent_fn") if agent_fn is not None
             else command_agent(agent_command, float(agent_timeout_s)))
    if tasks is not None and task_fn is not None:
        raise ValueError("tasks / task_fn: give at most one")
    if isinstance(tasks, str) and tasks.endswith(".jsonl"):
        tasks = read_jsonl_tasks(tasks)
    if tasks is not None:
        if isinstance(tasks, (str, bytes)) or not isinstance(tasks, Sequence) or not tasks:
            raise ValueError(f"tasks: must be a non-empty list or a .jsonl file, got "
                             f"{tasks!r:.60}")
        tasks = list(tasks)
    make_task = load_callable(task_fn, "task_fn") if task_fn is not None else None

    def factory(spec, run_seed: int) -> OutsideAgentEpisode:
        del run_seed
        if tasks is not None:
            task = tasks[(spec.seed // 2) % len(tasks)]
        elif make_task is not None:
            task = make_task(spec.seed)
        else:
            task = spec.seed
        return OutsideAgentEpisode(agent, task, agent_timeout_s)

    factory.runner = RUNNER  # rollout/runner.py: these episodes are played by it
    return factory


def is_outside_agent(env_type: str) -> bool:
    """Whether episodes of `env_type` are an outside agent's (`openai_agent`, `agent:…`)."""
    return env_type == ENV_TYPE or env_type.startswith(PREFIX)


def agent_builder(agent_path: str, **env_config):
    """The factory of ``agent:<agent_path>``: `outside_agent_factory` with that agent."""
    if "agent_fn" in env_config or "agent_command" in env_config:
        raise ValueError(f"{PREFIX}{agent_path}: the env type names the agent already; drop "
                         "env_config.agent_fn / agent_command")
    return outside_agent_factory(agent_fn=agent_path, **env_config)


def agent_metrics(episode_metrics: Sequence[dict], prefix: str = "") -> dict[str, float]:
    """Over a batch of outside agents' episodes (an episode's numbers ride on its first
    sample: `serving.agent_runner`): the totals of the ``agent/*`` counts, as
    ``{prefix}agent/<count>``, and the mean of each ``agent_metric/<name>`` the agents
    returned over the episodes that returned it; {} for a batch without them."""
    names = sorted({k for m in episode_metrics for k in m if k.startswith("agent/")})
    out = {f"{prefix}{k}": float(sum(m.get(k, 0.0) for m in episode_metrics)) for k in names}
    for name in sorted({k for m in episode_metrics for k in m
                        if k.startswith("agent_metric/")}):
        values = [m[name] for m in episode_metrics if name in m]
        out[f"{prefix}{name}"] = float(sum(values) / len(values))
    return out
