"""reasoning-gym tasks with the tiny tool model on CPU: one dataset item per episode, the
dataset's own `score_answer` as the reward (`envs/reasoning_gym_env.py`), the calculator as
a tool.

    pip install -e ".[envs]"
    python -m jaxrl_agentic.train --config configs/reasoning_gym.py
    python -m jaxrl_agentic.train --config configs/reasoning_gym.py \
        --config.env_id=reasoning_gym:gcd

`env_id` picks the dataset (`reasoning_gym:<name>`; an unknown name is a one-line config
error listing close matches) and `dataset_config` its parameters. The arithmetic
parameters below are marked as `basic_arithmetic`'s own (`env_specific_settings`,
jaxrl_agentic/env_specific.py): another dataset starts from its own defaults
(`dataset_config={}`), or from what `--config.custom_envs.task.env_config.dataset_config`
gives it. The default is
reasoning-gym's `basic_arithmetic` with two terms of one or two digits and + or −
("Calculate 13 - 92."), with the calculator as a tool and the tool recipes' model, warm-up,
GRPO and eval settings (`configs/tool_calculator.py`). Without a tool the tiny model did not
learn to compute such answers in minutes (0.00-0.03 through 350 steps,
docs/environments.md).

The format warm-up (`call_or_guess_policy`) shows two ways to reply: a third of its first
replies call `calculate` on the question's expression and answer the result, the rest answer
another item's answer. Greedy decoding after it guesses (held-out success 0.00-0.03); RL
learns that calling pays. Training and held-out items come from disjoint episode seeds.
"""

import os

from jaxrl_agentic.config import env_spec, env_specific_settings, recipe_config

ARITHMETIC = {"min_terms": 2, "max_terms": 2, "min_digits": 1, "max_digits": 2,
              "operators": ("+", "-"), "allow_parentheses": False, "allow_negation": False}


def get_config():
    c = recipe_config(os.path.join(os.path.dirname(os.path.abspath(__file__)),
                                   "tool_calculator.py"))
    c.exp_name = "reasoning_gym"
    c.custom_envs = {"task": env_spec(
        "reasoning_gym:basic_arithmetic", env_backend="python", max_turns=3,
        max_tokens_per_step=32, format_penalty=0.1, step_timeout_s=30.0,
        dataset_config=ARITHMETIC, tools=("calculate",), tool_error_penalty=0.1,
        max_calls_per_turn=2, call_timeout_s=1.0, max_steps_in_episode=3,
        call_style="compact")}
    # basic_arithmetic's parameters: another `env_id` takes its dataset's own defaults.
    env_specific_settings(c, "task", {"custom_envs.task.env_config.dataset_config": {}})
    # Only a third of the warm-up's episodes call the tool, so the copying a call needs takes
    # longer to form than on the calculator: after 1,000 steps the loss was still falling
    # steeply (0.50 -> 0.33 over the last 100) and the calls miscopied the numbers
    # (docs/environments.md).
    c.format_warmup.steps = 2000
    # The calculator recipe's managers (8 questions of 4 episodes a step; 32 held out).
    c.train_env_manager.tags = c.val_env_manager.tags = ("task",)
    return c
