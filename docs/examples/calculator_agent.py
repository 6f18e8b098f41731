"""An agent written against the OpenAI chat API: arithmetic word problems with a calculator.

It knows nothing of jaxrl_agentic: it calls the model, runs the tool the model asks for,
sends the result back, and reads the answer, as it would against any OpenAI-compatible
server. `configs/agent_calculator.py` trains it (env type `openai_agent`):

    python -m jaxrl_agentic.train --config configs/agent_calculator.py

Run by hand against another server (any OpenAI-compatible one):

    python docs/examples/calculator_agent.py --base-url http://127.0.0.1:8000/v1

The episode is the built-in `calculator` environment's (`envs/calculator.py`), written from
the outside: the same instructions, the same tool schema, up to 3 replies, reward 1 for the
right number, −0.1 for each malformed or failed call and each reply with neither a call
nor an answer (at most −0.5 in all). So the two recipes can be compared on equal terms.
"""

from __future__ import annotations

import argparse
import ast
import json
import operator
import random
import re
from fractions import Fraction

import openai

INSTRUCTIONS = ("Solve the arithmetic word problem. Use the calculate tool for the "
                "arithmetic, then reply <answer>NUMBER</answer>.")
TOOLS = [{"type": "function", "function": {
    "name": "calculate",
    "description": "Evaluate an arithmetic expression exactly. Numbers, + - * / and "
                   "parentheses only.",
    "parameters": {"type": "object",
                   "properties": {"expression": {"type": "string",
                                                 "description": "e.g. (12 + 30) * 4"}},
                   "required": ["expression"]}}}]
MAX_REPLIES, MAX_CALLS_PER_REPLY, PENALTY, MAX_PENALTY = 3, 2, 0.1, 0.5
NUDGE = ("Your reply had no tool call and no answer. Call a tool with "
         '<tool_call>{"name": "NAME", "arguments": {"ARGUMENT": "VALUE"}}</tool_call> or '
         "reply <answer>ANSWER</answer>.")
_OPS = {ast.Add: operator.add, ast.Sub: operator.sub, ast.Mult: operator.mul,
        ast.Div: operator.truediv}


def calculate(expression: str) -> str:
    """The tool: + − × ÷ and parentheses over numbers, exactly (fractions); an integer
    prints as one, anything else as a decimal to 12 significant digits."""
    def value(node):
        if isinstance(node, ast.BinOp) and type(node.op) in _OPS:
            return _OPS[type(node.op)](value(node.left), value(node.right))
        if isinstance(node, ast.UnaryOp) and isinstance(node.op, (ast.USub, ast.UAdd)):
            return -value(node.operand) if isinstance(node.op, ast.USub) else value(node.operand)
        if isinstance(node, ast.Constant) and type(node.value) in (int, float):
            return Fraction(str(node.value))
        raise ValueError("numbers, + - * / and parentheses only")

    if len(expression) > 200:
        raise ValueError("expression too long")
    result = value(ast.parse(expression, mode="eval").body)
    return str(result.numerator) if result.denominator == 1 else f"{float(result):.12g}"


def first_messages(task: dict) -> list[dict]:
    return [{"role": "user", "content": f"{INSTRUCTIONS}\nProblem: {task['question']}"}]


def run_call(call) -> tuple[str, bool]:
    """(the tool message, whether the call went wrong)."""
    try:
        if call.function.name != "calculate":
            return f"Error: unknown tool {call.function.name!r}; available: calculate.", True
        return calculate(str(json.loads(call.function.arguments)["expression"])), False
    except (ValueError, KeyError, TypeError, SyntaxError, ZeroDivisionError) as e:
        return f"Error: {e}.", True


def is_right(given: str, answer: int) -> bool:
    given = given.replace(",", "").strip()
    return bool(re.fullmatch(r"-?\d{1,30}(?:\.\d{1,30})?", given)) and Fraction(given) == answer


# One connection pool for every episode's client: a client that builds its own also builds
# an SSL context, ~50 ms of CPU (even for plain http), which across 32 episodes a step
# costs more than the endpoint itself.
HTTP = openai.DefaultHttpxClient()


def solve(base_url: str, api_key: str, task: dict) -> dict:
    """One episode → {"reward", "success", "metrics"} (a bare float would do too)."""
    client = openai.OpenAI(base_url=base_url, api_key=api_key, max_retries=0,
                           http_client=HTTP)
    messages, penalty, calls = first_messages(task), 0.0, 0
    for _ in range(MAX_REPLIES):
        try:
            reply = client.chat.completions.create(model="policy", messages=messages,
                                                   tools=TOOLS, max_tokens=32)
        except openai.BadRequestError:  # past the server's context or turns: the episode
            break                       # ends there, as the environment's would
        message = reply.choices[0].message
        messages.append(message.model_dump(exclude_none=True))  # sent back as it came
        if message.tool_calls:
            for k, call in enumerate(message.tool_calls):
                content, bad = (run_call(call) if k < MAX_CALLS_PER_REPLY else
                                (f"Error: at most {MAX_CALLS_PER_REPLY} tool calls per reply; "
                                 "this one was not run.", True))
                calls += 1
                penalty += PENALTY * bad
                messages.append({"role": "tool", "tool_call_id": call.id, "content": content})
            continue
        answer = re.search(r"<answer>(.*?)</answer>", message.content or "", re.DOTALL)
        if answer:
            right = is_right(answer.group(1), task["answer"])
            return {"reward": float(right) - min(penalty, MAX_PENALTY), "success": right,
                    "metrics": {"tool_calls": calls}}
        penalty += PENALTY  # neither a call nor an answer (a garbled call is text)
        messages.append({"role": "user", "content": NUDGE})
    return {"reward": -min(penalty, MAX_PENALTY), "success": False,
            "metrics": {"tool_calls": calls}}


def task(seed: int) -> dict:
    """The task of episode seed `seed`: the problem the built-in environment poses for that
    seed at run seed 0 (its generator, so that both recipes pose the same problems; an
    agent of your own reads its dataset: `tasks=` a list or a .jsonl file)."""
    from jaxrl_agentic.envs.calculator import make_problem

    question, _, answer = make_problem(random.Random(f"calculator:0:{int(seed)}"), 1,
                                       "two_digit")
    return {"question": question, "answer": answer}


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--base-url", required=True)
    parser.add_argument("--api-key", default="none")
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()
    print(json.dumps(solve(args.base_url, args.api_key, task(args.seed))))
