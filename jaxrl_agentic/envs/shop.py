"""`shop`: questions that need two different tools in sequence: `lookup` a price in the
shop's price list, `calculate` with it, then answer.

Each seed stocks a shop with 8 of 12 goods at unit prices of 2–49 coins and asks one
question about one of them. The price list is not in the prompt, so every question needs
both tools:

    How much do 6 lamps cost?                                        6 × price
    You have 90 coins and buy one lamp. How many coins are left?     90 − price
    You buy one lamp and pay 7 coins for delivery. How much is that in all?   price + 7

Tools:

- `lookup(item)`: `lamp: 23 coins` (singular or plural, any case); an item the shop does
  not sell is an error that lists what it sells (counted and penalised like any error);
- `calculate(expression)`: the calculator's tool (`envs/calculator.py`).

Reward 1 for the right number (the answer ends the episode), the `ToolEnv` penalties for
garbled calls and for replies with neither a call nor an answer. `ShopOracle` solves every
question from the messages alone: look the item up, calculate, answer (three turns).
"""

from __future__ import annotations

import random
import re
from typing import Any

from jaxrl_agentic.envs.calculator import CALCULATE, evaluate_expression, number_matches
from jaxrl_agentic.envs.mcp_tools import server_tools
from jaxrl_agentic.envs.tools import (
    Tool,
    ToolEnv,
    format_tool_call,
    tool_env_factory,
    tool_responses,
)

GOODS = (("apple", "apples"), ("lamp", "lamps"), ("candle", "candles"), ("kettle", "kettles"),
         ("basket", "baskets"), ("scarf", "scarves"), ("brush", "brushes"), ("mug", "mugs"),
         ("rope", "ropes"), ("towel", "towels"), ("pencil", "pencils"),
         ("bucket", "buckets"))
STOCKED = 8
# (question, expression over {n} and {price}); {one} is the singular name, {many} the plural.
QUESTIONS = (
    ("How much do {n} {many} cost?", "{n} * {price}"),
    ("You have {n} coins and buy one {one}. How many coins are left?", "{n} - {price}"),
    ("You buy one {one} and pay {n} coins for delivery. How much is that in all?",
     "{price} + {n}"),
)


def stock_shop(rng: random.Random) -> dict[str, int]:
    """{singular name: unit price} of `STOCKED` goods."""
    return {one: rng.randint(2, 49) for one, _ in rng.sample(GOODS, STOCKED)}


def lookup_price(shop: dict[str, int], item: str) -> str:
    """The `lookup` tool over `shop`."""
    key = item.strip().casefold()
    for one, many in GOODS:
        if key in (one, many) and one in shop:
            return f"{one}: {shop[one]} coins"
    raise ValueError(f"the shop does not sell {item!r}; it sells "
                     f"{', '.join(sorted(shop))}")


class ShopEnv(ToolEnv):
    """One shop and one question per episode; see the module doc."""

    instructions = ("Answer the question about the shop. Its prices are not given: look "
                    "the item up, use the calculate tool for the arithmetic, then reply "
                    "<answer>NUMBER</answer>.")

    def __init__(self, *, run_seed: int = 0, **tool_env_options: Any):
        self.shop: dict[str, int] = {}
        lookup = Tool(
            name="lookup", description="The unit price of an item the shop sells.",
            parameters={"type": "object", "properties": {"item": {
                "type": "string", "description": "e.g. lamp"}}, "required": ["item"]},
            fn=lambda item: lookup_price(self.shop, item))
        super().__init__([lookup, CALCULATE], **tool_env_options)
        self.run_seed = int(run_seed)
        self.expression: str | None = None

    def new_task(self, seed: int) -> tuple[str, int]:
        rng = random.Random(f"shop:{self.run_seed}:{int(seed)}")
        self.shop = stock_shop(rng)
        one = rng.choice(sorted(self.shop))
        many = dict(GOODS)[one]
        price = self.shop[one]
        question, expression = rng.choice(QUESTIONS)
        if "*" in expression:
            n = rng.randint(2, 9)
        elif "-" in expression:
            n = rng.randint(price + 1, 99)
        else:
            n = rng.randint(3, 30)
        self.expression = expression.format(n=n, price=price)
        answer = evaluate_expression(self.expression)
        return f"Question: {question.format(n=n, one=one, many=many)}", int(answer)

    def is_correct(self, given: str, answer: int) -> bool:
        return number_matches(given, answer)


def _question(text: str) -> str | None:
    m = re.search(r"Question: (.*)", text)
    return m.group(1).strip() if m else None


def _named_item(question: str) -> str | None:
    """The singular name of the good `question` asks about, or None."""
    return next((one for one, many in GOODS
                 if re.search(rf"\b({one}|{many})\b", question)), None)


def _price(result: str) -> str | None:
    """The price in a `lookup` result (`lamp: 23 coins`), or None for another result."""
    m = re.fullmatch(r"\w+: (\d+) coins", result.strip())
    return m.group(1) if m else None


class ShopOracle:
    """Solves every question from the messages alone: `lookup` the item named in the
    question, `calculate` the question's expression with the price, answer the result.
    `reply(new_text)` as `CalculatorOracle.reply`."""

    def __init__(self, call_style: str = "qwen"):
        self.call_style = call_style
        self.question = ""

    def reply(self, new_text: str) -> str:
        results = tool_responses(new_text)
        if not results:
            self.question = _question(new_text) or ""
            item = _named_item(self.question)
            if item is None:
                return "<answer>unknown</answer>"
            return format_tool_call("lookup", {"item": item}, self.call_style)
        price = _price(results[-1])
        if price is None:  # the calculator's result
            return f"<answer>{results[-1].strip()}</answer>"
        for question, expression in QUESTIONS:
            pattern = re.escape(question).replace(re.escape("{n}"), r"(\d+)")
            pattern = re.sub(r"\\\{(one|many)\\\}", r"\\w+", pattern)
            m = re.fullmatch(pattern, self.question)
            if m:
                expr = expression.format(n=m.group(1), price=price)
                return format_tool_call("calculate", {"expression": expr}, self.call_style)
        return "<answer>unknown</answer>"


def random_shop_policy(rng: random.Random, call_style: str = "qwen"):
    """A format-only policy: `lookup` the item the question names, `calculate` its price
    and the question's number in a random order with a random operator, answer the result.
    It teaches both calls, their order and copying names and numbers, not which operation
    a question needs."""
    state = {"question": ""}

    def reply(new_text: str) -> str:
        results = tool_responses(new_text)
        if not results:
            state["question"] = _question(new_text) or ""
            item = _named_item(state["question"]) or rng.choice(GOODS)[0]
            return format_tool_call("lookup", {"item": item}, call_style)
        price = _price(results[-1])
        if price is None:
            return f"<answer>{results[-1].strip()}</answer>"
        numbers = [price] + (re.findall(r"\d+", state["question"]) or ["1"])[:1]
        rng.shuffle(numbers)
        expression = f"{numbers[0]} {rng.choice('+-*')} {numbers[1]}"
        return format_tool_call("calculate", {"expression": expression}, call_style)

    return reply


def shop_factory(*, format_penalty: float = 0.1, tool_error_penalty: float = 0.1,
                 max_calls_per_turn: int = 2, call_timeout_s: float = 1.0,
                 max_steps_in_episode: int = 5, max_tool_error_penalty: float = 0.5,
                 call_style: str = "qwen", extra_tools: tuple[str, ...] = (),
                 mcp_servers: tuple[str, ...] = ()):
    """`make_python_env("shop", **config)`: the episode factory."""
    options = dict(format_penalty=format_penalty, tool_error_penalty=tool_error_penalty,
                   max_calls_per_turn=max_calls_per_turn, call_timeout_s=call_timeout_s,
                   max_steps_in_episode=max_steps_in_episode,
                   max_tool_error_penalty=max_tool_error_penalty, call_style=call_style,
                   extra_tools=tuple(extra_tools) + server_tools(mcp_servers, call_timeout_s))
    return tool_env_factory(ShopEnv, **options)
