"""Tool use over several turns with two different tools: the shop's questions.

    python -m jaxrl_agentic.train --config configs/tool_multistep.py

Each episode is one question about one item of a shop whose price list is not in the prompt
(`shop`, a Python environment, docs/environments.md): the model calls `lookup` for the
item's price, reads it in a `tool` message, calls `calculate` with the price and the
question's number, reads the result, and answers `<answer>N</answer>` (three turns):

    How much do 6 lamps cost?                                        6 × price
    You have 90 coins and buy one lamp. How many coins are left?     90 − price
    You buy one lamp and pay 7 coins for delivery. How much is that in all?   price + 7

Reward 1 for the right number; −0.1 per garbled call and per reply with neither a call nor
an answer (at most 0.5 an episode). Metrics: `env/tool/calls_per_episode`, tool errors by
kind (`env/tool/errors_*`), `env/tool/turns_to_answer`.

The format warm-up (`random_shop_policy`) looks the named item up, then calculates the price
and the question's number in a random order with a random operator, and answers the result:
it teaches both calls, their order and the copying, not which operation a question needs.
RL must learn that from the words (lamps cost → ×, coins left → −, delivery → +).
"""

import os

from jaxrl_agentic.config import env_spec, recipe_config


def get_config():
    # The calculator recipe's tokenizer, warm-up, GRPO and eval settings; another env.
    c = recipe_config(os.path.join(os.path.dirname(os.path.abspath(__file__)),
                                   "tool_calculator.py"))
    c.exp_name = "tool_multistep"
    # The first prompt (two tools' schemas + question) is ~75 tokens; three replies and two
    # tool results follow it.
    c.max_input_length = 640
    c.sequence_length = 768
    # The warm-up must teach copying from three places (the question's number, the looked-up
    # price, the tool's result): after 600 steps 7 of 32 held-out calls held the question's
    # number, after 2,000 (loss 0.08, ~9.5 minutes on one core) 29 of 32 (docs/benchmarks.md).
    c.format_warmup.steps = 2000
    c.format_warmup.max_turns = 3  # lookup, calculate, answer: every turn's format
    c.custom_envs = {"shop": env_spec(
        "shop", env_backend="python", max_turns=4, max_tokens_per_step=32,
        format_penalty=0.1, step_timeout_s=30.0, tool_error_penalty=0.1,
        max_calls_per_turn=2, call_timeout_s=1.0, max_steps_in_episode=4,
        call_style="compact")}
    # The calculator recipe's managers (8 questions of 4 episodes a step; 32 held out), on
    # the shop.
    c.train_env_manager.tags = c.val_env_manager.tags = ("shop",)
    return c
