"""An agent written elsewhere, trained as it is: the calculator task as a plain OpenAI-client
loop (docs/examples/calculator_agent.py) against the endpoint the trainer serves.

    python -m jaxrl_agentic.train --config configs/agent_calculator.py

Everything but the environment is `configs/tool_calculator.py`'s: the tiny model with the
tool tokenizer, its 1,000-step format warm-up, GRPO over 8 problems × 4 episodes a step.
The agent sends the built-in environment's instructions and tool schema, so its prompts
are token for token the built-in environment's (tests/test_agent_calculator.py), and the
two recipes' curves compare the endpoint path with the in-process one (docs/outside_agents.md).

The warm-up cannot script an outside agent (the agent writes the chat), so the built-in
`calculator` stays in `custom_envs` for the warm-up alone: no manager plays it, and the
warmed model is the one `tool_calculator.py` builds (the same cache entry).
"""

import os

from jaxrl_agentic.config import env_manager, env_spec, recipe_config

HERE = os.path.dirname(os.path.abspath(__file__))
AGENT = os.path.join(HERE, "..", "docs", "examples", "calculator_agent.py")


def get_config():
    c = recipe_config(os.path.join(HERE, "tool_calculator.py"))
    c.exp_name = "agent_calculator"
    c.custom_envs.agent = env_spec(
        "openai_agent", max_turns=3, max_tokens_per_step=32,
        agent_fn=f"{os.path.normpath(AGENT)}:solve", task_fn=f"{os.path.normpath(AGENT)}:task",
        agent_timeout_s=120.0)
    c.train_env_manager = env_manager(num_env_groups=8, group_size=4, tags=("agent",))
    c.val_env_manager = env_manager(num_env_groups=32, group_size=1, tags=("agent",))
    return c
