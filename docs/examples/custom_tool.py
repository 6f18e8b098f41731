"""A tool of its own, offered to a tool environment: `percent_of` beside `calculate`.

    python -m jaxrl_agentic.train --config docs/examples/custom_tool.py

`register_tool(Tool(...))` makes a tool available by name; a tool environment's
`extra_tools=("percent_of",)` lists its schema in the system turn of every episode and
routes calls to it, with the same error handling as the environment's own tools (a bad
call is an `Error: …` tool message, counted and charged). Here the calculator's word
problems are played with both tools.
"""

import os

from jaxrl_agentic.config import recipe_config
from jaxrl_agentic.envs import Tool, register_tool


def percent_of(percent: float, value: float) -> str:
    return f"{percent * value / 100:g}"


register_tool(Tool(
    name="percent_of",
    description="percent % of value, e.g. percent_of(15, 80) = 12.",
    parameters={"type": "object",
                "properties": {"percent": {"type": "number"}, "value": {"type": "number"}},
                "required": ["percent", "value"]},
    fn=percent_of), replace=True)


def get_config():
    c = recipe_config(os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "..",
                                   "configs", "tool_calculator.py"))
    c.exp_name = "tool_calculator_percent"
    c.custom_envs.calculator.env_config.extra_tools = ("percent_of",)
    # A second schema in the system turn: room for the longer first prompt.
    c.max_input_length = 1024
    c.sequence_length = c.micro_batch_max_tokens = 1088
    return c
