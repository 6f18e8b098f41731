"""Agents written elsewhere as an environment type: `openai_agent`.

Most agents people want to train are programs written against the OpenAI chat API (with
tools in OpenAI's function-calling format). Such a program *is* the environment of its
episode: it sends the chat, reads the replies, calls its own tools, and knows how well it
did. An episode of `openai_agent` runs it, pointed at an OpenAI-compatible endpoint the
trainer serves from its own policy (`jaxrl_agentic/serving/`), and the number it returns is
the episode's reward:

    agent_fn(base_url: str, api_key: str, task) -> float     # e.g. "my_agents:solve"

    custom_envs.<tag>.env_type = "openai_agent"
    custom_envs.<tag>.env_config = {"agent_fn": "my_agents:solve", "tasks": [...]}

env_config:

- ``agent_fn``: a ``"module:function"`` path (or the callable itself) called on an agent
  thread per episode; or ``agent_command``: a program (a string split like a shell command,
  or a list) run per episode with ``OPENAI_BASE_URL``, ``OPENAI_API_KEY`` and
  ``AGENT_TASK`` (the task as JSON) in its environment, whose last line of output is the
  reward. Exactly one of the two.
- ``tasks``: a list; episode seed s plays ``tasks[(s // 2) % len(tasks)]``: training seeds
  are even, 2·(cursor + group), validation's odd, 2·group + 1 (`rollout/groups.py`), so
  both walk the list in order (a validation manager's ``env_config`` may give it a list of
  its own: held-out tasks). Or ``task_fn``: a ``"module:function"`` path,
  ``task_fn(seed) -> task``. Without either, the task is the seed. Members of a group share
  their seed, hence their task: GRPO compares attempts at the same task.
- ``agent_timeout_s`` (default 600): an agent still running then is abandoned (its thread
  cannot be killed); its episode gets reward 0 and counts in ``agent/timeouts``.

An `OutsideAgentEpisode` holds what one episode runs; it is not stepped like the other
Python environments (its `reset` and `step` say so): `serving.AgentRolloutRunner` plays it.
"""

from __future__ import annotations

import importlib
import json
import math
import os
import shlex
import subprocess
from collections.abc import Callable, Sequence
from typing import Any

from jaxrl_agentic.envs.python_env import PythonTextEnv

ENV_TYPE = "openai_agent"
DEFAULT_AGENT_TIMEOUT_S = 600.0
# The runner that plays these episodes, named (it lives above this layer).
RUNNER = "jaxrl_agentic.serving.agent_runner:agent_rollout_runner"

AgentFn = Callable[[str, str, Any], float]


def load_callable(path: str | Callable, field: str) -> Callable:
    """The callable `path` names (``"package.module:function"``, attributes dotted after the
    colon), or `path` itself when it is callable; a ValueError naming `field` otherwise."""
    if callable(path):
        return path
    if not isinstance(path, str) or path.count(":") != 1:
        raise ValueError(f"{field}: must be 'module:function', got {path!r}")
    module_name, attr = path.split(":")
    try:
        obj = importlib.import_module(module_name)
    except ImportError as e:
        raise ValueError(f"{field}: cannot import module {module_name!r} ({e})") from None
    for part in attr.split("."):
        if not hasattr(obj, part):
            raise ValueError(f"{field}: module {module_name!r} has no {attr!r}")
        obj = getattr(obj, part)
    if not callable(obj):
        raise ValueError(f"{field}: {path!r} is not callable")
    return obj


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


def checked_reward(value) -> float:
    """`value` as a finite float; a ValueError (bool, non-number, NaN, inf) otherwise."""
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise ValueError(f"the agent returned {type(value).__name__} {value!r:.60}, not a "
                         f"number")
    if not math.isfinite(value):
        raise ValueError(f"the agent returned a non-finite reward {value!r}")
    return float(value)


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
    if tasks is not None:
        if isinstance(tasks, (str, bytes)) or not isinstance(tasks, Sequence) or not tasks:
            raise ValueError(f"tasks: must be a non-empty list, got {tasks!r:.60}")
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


def agent_metrics(episode_metrics: Sequence[dict], prefix: str = "") -> dict[str, float]:
    """Totals over a batch of the ``agent/*`` counts its outside agents' trajectories carry
    (an episode's counts ride on its first sample: `serving.agent_runner`), as
    ``{prefix}agent/<count>``; {} for a batch without them."""
    names = sorted({k for m in episode_metrics for k in m if k.startswith("agent/")})
    return {f"{prefix}{k}": float(sum(m.get(k, 0.0) for m in episode_metrics)) for k in names}
