"""Text environments: gymnax-API environments a language model plays through text.

    env, env_params = make("frozen_lake", is_slippery=True)
    obs, state = env.reset(key, env_params)
    prompt = env.instructions(env_params) + "\\n" + env.render_text(state, env_params)
    action = env.parse_action(reply)  # None -> pass INVALID_ACTION
    obs, state, reward, terminated, truncated, info = env.step(key, state, action, env_params)

See docs/environments.md for the rules of each environment and how to add one.
"""

from jaxrl_agentic.envs.base import (
    INVALID_ACTION,
    TextEnvironment,
    TextEnvParams,
    format_instructions,
)
from jaxrl_agentic.envs.calculator import CALCULATE, calculator_factory
from jaxrl_agentic.envs.frozen_lake import FrozenLake, FrozenLakeParams, FrozenLakeState
from jaxrl_agentic.envs.gymnax_adapter import GymnaxTextAdapter, GymnaxTextParams, GymnaxTextState
from jaxrl_agentic.envs.lookup import lookup_factory
from jaxrl_agentic.envs.metrics import episode_metrics
from jaxrl_agentic.envs.outside_agent import ENV_TYPE as OUTSIDE_AGENT
from jaxrl_agentic.envs.outside_agent import PREFIX as OUTSIDE_AGENT_PREFIX
from jaxrl_agentic.envs.outside_agent import agent_builder, outside_agent_factory
from jaxrl_agentic.envs.parsing import parse_action
from jaxrl_agentic.envs.python_env import register_python_env

# Families of environments other libraries define register their prefix on import
# (`reasoning_gym:<dataset>`, `textarena:<EnvId>`); the libraries themselves are imported
# only when one is built.
from jaxrl_agentic.envs.reasoning_gym_env import reasoning_gym_builder  # noqa: F401
from jaxrl_agentic.envs.registry import make, register, register_prefix, registered_envs
from jaxrl_agentic.envs.shop import shop_factory
from jaxrl_agentic.envs.sokoban import Sokoban, SokobanParams, SokobanState
from jaxrl_agentic.envs.textarena_env import textarena_builder  # noqa: F401
from jaxrl_agentic.envs.tools import (
    Tool,
    ToolResultTypeError,
    ToolUnavailableError,
    register_tool,
    registered_tools,
)

# The built-in tool environments, registered here, above both them and the Python registry
# they join (`python_env.py`, which `tools.py` builds on): any import of the package does it.
register_python_env("calculator", calculator_factory)
register_python_env("lookup", lookup_factory)
register_python_env("shop", shop_factory)
# Agents written against the OpenAI API, played through the trainer's endpoint (`serving/`).
register_python_env(OUTSIDE_AGENT, outside_agent_factory)
register_prefix(OUTSIDE_AGENT_PREFIX, agent_builder)  # agent:<module>:<function>
register_tool(CALCULATE)  # a tool any tool environment can offer (`extra_tools`)

__all__ = [
    "INVALID_ACTION",
    "FrozenLake",
    "FrozenLakeParams",
    "FrozenLakeState",
    "GymnaxTextAdapter",
    "GymnaxTextParams",
    "GymnaxTextState",
    "Sokoban",
    "SokobanParams",
    "SokobanState",
    "TextEnvParams",
    "TextEnvironment",
    "episode_metrics",
    "format_instructions",
    "make",
    "parse_action",
    "Tool",
    "ToolResultTypeError",
    "ToolUnavailableError",
    "register",
    "register_python_env",
    "register_tool",
    "registered_envs",
    "registered_tools",
]
