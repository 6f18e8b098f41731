"""`calculator`: arithmetic word problems and a `calculate(expression)` tool.

Each seed draws a word problem from a fixed set of templates with numbers large enough
that mental arithmetic is unreliable (products of two-digit numbers, sums of four-digit
ones, exact divisions of three- and four-digit numbers). The answer is always an integer.
The tool evaluates numbers, `+ - * /` (also `×` `÷`), unary minus and parentheses exactly
(rational arithmetic) with a small recursive-descent parser: no Python `eval`, no names,
no powers, bounded length and nesting, so no expression can run long.

    factory = make_python_env("calculator", operations=1)   # one-operation problems only
    env = factory(EpisodeSpec(seed=3, group_id=0, member=0), run_seed=0)
    text = env.reset(3)          # instructions + "Problem: …"
    env.step('<tool_call>\n{"name": "calculate", "arguments": {"expression": "37 * 48"}}\n'
             '</tool_call>')     # → PyStep(tool_messages=("1776",), ...)
    env.step("<answer>1776</answer>")

`CalculatorOracle` solves every problem from the text alone (one call, then the answer);
`random_calculator_policy` writes well-formed calls on random numbers of the problem with
random operators, then answers with the result (the format warm-up's policy).
"""

from __future__ import annotations

import decimal
import random
import re
from fractions import Fraction
from typing import Any

from jaxrl_agentic.envs.mcp_tools import server_tools
from jaxrl_agentic.envs.tools import (
    Tool,
    ToolEnv,
    format_tool_call,
    tool_env_factory,
    tool_responses,
)

MAX_EXPRESSION_CHARS = 200
MAX_NESTING = 20
_TOKEN = re.compile(r"\s*(?:(\d+(?:\.\d+)?)|([-+*/()×÷]))")


def evaluate_expression(expression: str) -> Fraction:
    """The exact value of an arithmetic expression; ValueError (one line) if it is not one.

    Grammar: expr = term (("+" | "-") term)*; term = unary (("*" | "/") unary)*;
    unary = "-" unary | "+" unary | atom; atom = NUMBER | "(" expr ")".
    """
    if not isinstance(expression, str):
        raise ValueError("the expression must be a string")
    if len(expression) > MAX_EXPRESSION_CHARS:
        raise ValueError(f"expression longer than {MAX_EXPRESSION_CHARS} characters")
    tokens, pos = [], 0
    while pos < len(expression):
        if expression[pos:].strip() == "":
            break
        m = _TOKEN.match(expression, pos)
        if m is None:
            raise ValueError(f"unexpected character {expression[pos:].lstrip()[0]!r}; use "
                             "numbers, + - * / and parentheses")
        tokens.append(m.group(1) or {"×": "*", "÷": "/"}.get(m.group(2), m.group(2)))
        pos = m.end()
    if not tokens:
        raise ValueError("empty expression")
    parser = _Parser(tokens)
    value = parser.expr(0)
    if parser.i != len(tokens):
        raise ValueError(f"unexpected {tokens[parser.i]!r}")
    return value


class _Parser:
    def __init__(self, tokens: list[str]):
        self.tokens, self.i = tokens, 0

    def _peek(self) -> str | None:
        return self.tokens[self.i] if self.i < len(self.tokens) else None

    def expr(self, depth: int) -> Fraction:
        value = self.term(depth)
        while self._peek() in ("+", "-"):
            op = self.tokens[self.i]
            self.i += 1
            rhs = self.term(depth)
            value = value + rhs if op == "+" else value - rhs
        return value

    def term(self, depth: int) -> Fraction:
        value = self.unary(depth)
        while self._peek() in ("*", "/"):
            op = self.tokens[self.i]
            self.i += 1
            rhs = self.unary(depth)
            if op == "/" and rhs == 0:
                raise ValueError("division by zero")
            value = value * rhs if op == "*" else value / rhs
        return value

    def unary(self, depth: int) -> Fraction:
        sign = 1
        while self._peek() in ("+", "-"):
            sign = -sign if self.tokens[self.i] == "-" else sign
            self.i += 1
        return sign * self.atom(depth)

    def atom(self, depth: int) -> Fraction:
        token = self._peek()
        if token is None:
            raise ValueError("the expression ends too early")
        if token == "(":
            if depth >= MAX_NESTING:
                raise ValueError(f"more than {MAX_NESTING} nested parentheses")
            self.i += 1
            value = self.expr(depth + 1)
            if self._peek() != ")":
                raise ValueError("missing )")
            self.i += 1
            return value
        if token[0].isdigit():
            self.i += 1
            return Fraction(token)
        raise ValueError(f"unexpected {token!r}")


def format_number(value: Fraction) -> str:
    """An integer exactly; anything else as a decimal to 12 significant digits."""
    if value.denominator == 1:
        return str(value.numerator)
    with decimal.localcontext() as ctx:
        ctx.prec = 12
        text = str(+(decimal.Decimal(value.numerator) / decimal.Decimal(value.denominator)))
    return text


def calculate(expression: str) -> str:
    """The `calculate` tool: the value of `expression` (numbers, + - * / and parentheses)."""
    return format_number(evaluate_expression(expression))


CALCULATE = Tool(
    name="calculate",
    description="Evaluate an arithmetic expression exactly. Numbers, + - * / and "
                "parentheses only.",
    parameters={"type": "object",
                "properties": {"expression": {"type": "string",
                                              "description": "e.g. (12 + 30) * 4"}},
                "required": ["expression"]},
    fn=calculate,
)

# (problem text with {a} {b} {c}, expression over a, b, c). Numbers are drawn so that
# every intermediate and the answer are positive integers.
ONE_OP = (
    ("A warehouse has {a} crates with {b} bottles in each crate. How many bottles are in "
     "the warehouse?", "{a} * {b}"),
    ("A library had {a} books and received {b} more. How many books does it have now?",
     "{a} + {b}"),
    ("A tank held {a} litres of water and {b} litres were used. How many litres are left?",
     "{a} - {b}"),
    ("{a} marbles are shared equally among {b} children. How many marbles does each child "
     "get?", "{a} / {b}"),
)
TWO_OP = (
    ("A shop sells {a} boxes of {b} pencils each, plus {c} loose pencils. How many pencils "
     "does it sell?", "{a} * {b} + {c}"),
    ("A school orders {a} packs of {b} sheets and uses {c} sheets. How many sheets are "
     "left?", "{a} * {b} - {c}"),
    ("{a} people each pay {b} dollars, and the total is split equally among {c} groups. "
     "How many dollars does each group get?", "{a} * {b} / {c}"),
    ("A farmer has {a} hens and buys {b} more. Each hen lays {c} eggs a month. How many "
     "eggs are laid in a month?", "({a} + {b}) * {c}"),
)


def _draw_numbers(rng: random.Random, expression: str) -> dict[str, int]:
    if expression == "{a} * {b}":
        return {"a": rng.randint(13, 99), "b": rng.randint(13, 99)}
    if expression == "{a} + {b}":
        return {"a": rng.randint(1000, 9999), "b": rng.randint(1000, 9999)}
    if expression == "{a} - {b}":
        a = rng.randint(3000, 9999)
        return {"a": a, "b": rng.randint(1000, a - 1000)}
    if expression == "{a} / {b}":
        b = rng.randint(12, 49)
        return {"a": b * rng.randint(13, 99), "b": b}
    if expression == "{a} * {b} + {c}":
        return {"a": rng.randint(13, 99), "b": rng.randint(13, 99), "c": rng.randint(13, 99)}
    if expression == "{a} * {b} - {c}":
        return {"a": rng.randint(13, 99), "b": rng.randint(13, 99), "c": rng.randint(13, 168)}
    if expression == "{a} * {b} / {c}":
        c = rng.randint(3, 12)
        return {"a": c * rng.randint(3, 30), "b": rng.randint(13, 99), "c": c}
    if expression == "({a} + {b}) * {c}":
        return {"a": rng.randint(120, 999), "b": rng.randint(13, 99), "c": rng.randint(13, 31)}
    raise ValueError(f"no number ranges for {expression!r}")


def _draw_two_digit_numbers(rng: random.Random, expression: str) -> dict[str, int]:
    """Every given number 10-99 except a divisor and the last factor of a product, 2-9, so
    that a one-operation answer has at most three digits (a four-digit product is the
    number a small model most often miscopies from the tool's result into its answer);
    intermediates and the answer are positive integers."""
    small = rng.randint(2, 9)
    if "/" in expression:  # "{a} / {b}" and "{a} * {b} / {c}": the divisor divides a
        a = small * rng.randint(-(-10 // small), 99 // small)
        return {"a": a, "b": small} if expression == "{a} / {b}" else {
            "a": a, "b": rng.randint(2, 9), "c": small}
    numbers = {k: rng.randint(10, 99) for k in "abc"}
    if expression == "{a} - {b}":
        numbers["a"] = rng.randint(21, 99)
        numbers["b"] = rng.randint(10, numbers["a"] - 1)
    elif expression == "({a} + {b}) * {c}":
        numbers["c"] = small
    elif "*" in expression:  # "{a} * {b}", "{a} * {b} + {c}", "{a} * {b} - {c}"
        numbers["b"] = small
        if expression == "{a} * {b} - {c}":  # a·b ≥ 20
            numbers["c"] = rng.randint(10, min(99, numbers["a"] * small - 1))
    return numbers


NUMBER_SIZES = ("large", "two_digit")


def make_problem(rng: random.Random, operations: int = 0,
                 number_size: str = "large") -> tuple[str, str, int]:
    """(problem text, expression, answer) for `operations` 1, 2 or 0 (either).
    `number_size`: "large" (two- to four-digit numbers, by operation) or "two_digit" (every
    given number 10-99 except a divisor and a product's last factor, 2-9: fewer digits to
    copy into a call and out of its result)."""
    if operations not in (0, 1, 2):
        raise ValueError(f"operations must be 0 (mixed), 1 or 2, got {operations}")
    if number_size not in NUMBER_SIZES:
        raise ValueError(f"number_size must be one of {NUMBER_SIZES}, got {number_size!r}")
    pool = {1: ONE_OP, 2: TWO_OP, 0: ONE_OP + TWO_OP}[operations]
    text, expression = rng.choice(pool)
    draw = _draw_numbers if number_size == "large" else _draw_two_digit_numbers
    numbers = draw(rng, expression)
    expr = expression.format(**numbers)
    answer = evaluate_expression(expr)
    assert answer.denominator == 1 and answer > 0, expr  # the ranges guarantee it
    return text.format(**numbers), expr, int(answer)


class CalculatorEnv(ToolEnv):
    """One word problem per episode (`operations`: 1, 2 or 0 = either); see module doc."""

    instructions = ("Solve the arithmetic word problem. Use the calculate tool for the "
                    "arithmetic, then reply <answer>NUMBER</answer>.")

    def __init__(self, *, run_seed: int = 0, operations: int = 0, number_size: str = "large",
                 **tool_env_options: Any):
        super().__init__([CALCULATE], **tool_env_options)
        make_problem(random.Random(0), operations, number_size)  # bad values fail here
        self.run_seed, self.operations = int(run_seed), int(operations)
        self.number_size = number_size
        self.expression: str | None = None

    def new_task(self, seed: int) -> tuple[str, int]:
        # A str seed is hashed with sha512 by `random`: the same task in every process.
        rng = random.Random(f"calculator:{self.run_seed}:{int(seed)}")
        text, self.expression, answer = make_problem(rng, self.operations, self.number_size)
        return f"Problem: {text}", answer

    def is_correct(self, given: str, answer: int) -> bool:
        return number_matches(given, answer)


def number_matches(given: str, answer: int | Fraction) -> bool:
    """Whether the answer text `given` is the number `answer` (digits, an optional sign and
    decimals, thousands commas ignored; nothing else)."""
    given = given.replace(",", "").strip()
    if not re.fullmatch(r"-?\d{1,30}(?:\.\d{1,30})?", given):
        return False
    return Fraction(given) == answer


def _call(expression: str, call_style: str) -> str:
    return format_tool_call("calculate", {"expression": expression}, call_style)


def _problem(text: str) -> str | None:
    m = re.search(r"Problem: (.*)", text)
    return m.group(1).strip() if m else None


def _template_regex(template: str) -> re.Pattern:
    parts = re.split(r"(\{[abc]\})", template)
    return re.compile("".join(f"(?P<{p[1]}>\\d+)" if re.fullmatch(r"\{[abc]\}", p)
                              else re.escape(p) for p in parts))


_TEMPLATES = [(_template_regex(text), expression) for text, expression in ONE_OP + TWO_OP]


class CalculatorOracle:
    """Solves every problem from the messages alone: it reads the problem, matches it to
    its template, asks `calculate` for the template's expression, and answers the result.

    `reply(new_text)`: `new_text` is what arrived since its last reply (the first user
    message, or the tool messages as `tool_response_text` renders them). `call_style`: the
    form of its calls (`envs.tools.CALL_STYLES`)."""

    def __init__(self, call_style: str = "qwen"):
        self.call_style = call_style

    def reply(self, new_text: str) -> str:
        results = tool_responses(new_text)
        if results:
            return f"<answer>{results[-1].strip()}</answer>"
        problem = _problem(new_text) or ""  # may run on into chat-template text
        for pattern, expression in _TEMPLATES:
            m = pattern.match(problem)
            if m:
                return _call(expression.format(**m.groupdict()), self.call_style)
        return "<answer>unknown</answer>"


def random_calculator_policy(rng: random.Random, call_style: str = "qwen"):
    """A format-only policy: a well-formed call (in `call_style`) joining the problem's
    numbers, in the order the problem gives them, with random operators; then the result
    as the answer. It teaches the call and answer format and copying the numbers, not which
    operation a problem needs: a one-operation problem gets its operator right one time in
    four."""

    def reply(new_text: str) -> str:
        results = tool_responses(new_text)
        if results:
            return f"<answer>{results[-1].strip()}</answer>"
        numbers = re.findall(r"\d+", _problem(new_text) or "") or ["1", "1"]
        expression = numbers[0]
        for n in numbers[1:]:
            expression += f" {rng.choice('+-*/')} {n}"
        return _call(expression, call_style)

    return reply


def calculator_factory(*, operations: int = 0, number_size: str = "large",
                       format_penalty: float = 0.1,
                       tool_error_penalty: float = 0.1, max_calls_per_turn: int = 3,
                       call_timeout_s: float = 1.0, max_steps_in_episode: int = 4,
                       max_tool_error_penalty: float = 0.5, call_style: str = "qwen",
                   extra_tools: tuple[str, ...] = (), mcp_servers: tuple[str, ...] = ()):
    """`make_python_env("calculator", **config)`: the episode factory."""
    options = dict(operations=operations, number_size=number_size,
                   format_penalty=format_penalty,
                   tool_error_penalty=tool_error_penalty,
                   max_calls_per_turn=max_calls_per_turn, call_timeout_s=call_timeout_s,
                   max_steps_in_episode=max_steps_in_episode,
                   max_tool_error_penalty=max_tool_error_penalty, call_style=call_style,
                   extra_tools=tuple(extra_tools) + server_tools(mcp_servers, call_timeout_s))
    return tool_env_factory(CalculatorEnv, **options)

