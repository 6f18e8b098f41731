"""One rollout interface over JAX and Python environments.

Both runners play a batch of episodes to the end with one sampler and return their
trajectories, token for token the same for the same seeds (a JAX environment run through the
Python adapter included); what differs is the environment side (vmapped and jitted in
`loop.py`, stateful objects on a thread pool in `python_runner.py`). `make_runner` builds
the one a registered environment needs (`envs/registry.py`: each declares its backend).
A Python environment whose episodes another runner plays names it: its factory's `runner`
attribute, a ``"module:function"`` path called as ``(factory, sampler, formatter, tag=…,
max_turns=…, …)`` (`openai_agent`'s is `jaxrl_agentic.serving.AgentRolloutRunner`, above
this layer, so it is named, not imported).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any, Protocol

import numpy as np

from jaxrl_agentic.data.trajectory import Trajectory
from jaxrl_agentic.envs.outside_agent import load_callable
from jaxrl_agentic.envs.python_env import make_python_env
from jaxrl_agentic.envs.registry import make, resolve_backend
from jaxrl_agentic.rollout.groups import EpisodeSpec
from jaxrl_agentic.rollout.history import FULL, HistoryPolicy
from jaxrl_agentic.rollout.loop import RolloutRunner
from jaxrl_agentic.rollout.python_runner import DEFAULT_STEP_TIMEOUT_S, PythonRolloutRunner
from jaxrl_agentic.rollout.turns import GenerationConfig


class EpisodeRunner(Protocol):
    """What the pipeline, the warm-up and evaluation ask of a rollout runner."""

    tag: str

    def run(self, episodes: Sequence[EpisodeSpec], *, sample_seed: int,
            traj_id_start: int = 0, params=None, greedy: bool | None = None,
            temperature: float | None = None) -> list[Trajectory]:
        """Plays `episodes` to the end; `greedy` / `temperature` override the generation
        config (eval)."""

    def replay_frames(self, traj: Trajectory) -> list[np.ndarray]:
        """RGB frames of a played episode ([] when the environment has no picture)."""


def make_runner(env_type: str, env_config: dict[str, Any], sampler, formatter, *, tag: str,
                max_turns: int, max_input_length: int, generation: GenerationConfig,
                format_penalty: float, backend: str = "auto", run_seed: int = 0,
                step_timeout_s: float = DEFAULT_STEP_TIMEOUT_S, max_workers: int = 0,
                batching: str = "turn", slots: int = 0, decode_chunk: int = 8,
                history: HistoryPolicy = FULL) -> EpisodeRunner:
    """The runner of `env_type` on `backend` ("auto": the one it was registered on), built
    with the environment's `env_config`, `format_penalty` and `history` policy
    (`rollout/history.py`; an environment with a runner of its own plays "full" only)."""
    common = dict(tag=tag, max_turns=max_turns, max_input_length=max_input_length,
                  generation=generation, run_seed=run_seed, batching=batching, slots=slots,
                  decode_chunk=decode_chunk)
    if resolve_backend(env_type, backend) == "python":  # host-side envs, thread pool
        factory = make_python_env(env_type, format_penalty=format_penalty, **env_config)
        own_runner = getattr(factory, "runner", None)
        if own_runner is not None:  # e.g. openai_agent: `serving.AgentRolloutRunner`
            if history.rewrites:  # its episodes' histories are not the rollout loop's
                raise ValueError(f"custom_envs.{tag}.history: {env_type!r} is played by "
                                 f"its own runner ({own_runner}), which keeps the full "
                                 "history; use history='full'")
            return load_callable(own_runner, f"{env_type} runner")(
                factory, sampler, formatter, **common)
        return PythonRolloutRunner(factory, sampler, formatter, step_timeout_s=step_timeout_s,
                                   max_workers=max_workers, history=history, **common)
    env, env_params = make(env_type, format_penalty=format_penalty, **env_config)
    return RolloutRunner(env, env_params, sampler, formatter, history=history, **common)
