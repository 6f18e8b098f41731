"""`calculator`: the safe evaluator, the problems, the oracle on 256 seeds."""

import random
import re
from fractions import Fraction

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from jaxrl_agentic.envs.calculator import (
    CalculatorOracle,
    calculate,
    evaluate_expression,
    random_calculator_policy,
)
from jaxrl_agentic.envs.python_env import make_python_env, registered_python_envs
from jaxrl_agentic.envs.tools import tool_response_text
from jaxrl_agentic.rollout.groups import EpisodeSpec


def play(env, policy, seed):
    """(last step, all steps) of one episode where `policy(new_text) -> reply` plays."""
    text, steps = env.reset(seed), []
    for _ in range(env.max_steps_in_episode):
        step = env.step(policy(text))
        steps.append(step)
        if step.terminated:
            break
        text = tool_response_text(step.tool_messages) if step.tool_messages else step.observation
    return steps[-1], steps


@pytest.mark.parametrize("expression, value", [
    ("12 * 37", 444), ("9453 - 8057", 1396), ("(347 + 128) * 12", 5700), ("1000 / 8", 125),
    ("7 ÷ 2", Fraction(7, 2)), ("3 × -4", -12), ("-(2 + 3) * --2", -10), ("2 + 3 * 4", 14),
    ("10 - 4 - 3", 3), ("64 / 4 / 2", 8), (" 1.5 + 0.25 ", Fraction(7, 4)),
])
def test_evaluate_expression_hand_computed(expression, value):
    assert evaluate_expression(expression) == value


def test_calculate_formats_integers_exactly_and_fractions_as_decimals():
    assert calculate("99999999999 * 99999999999") == "9999999999800000000001"
    assert calculate("1 / 3") == "0.333333333333" and calculate("7 / 2") == "3.5"


@pytest.mark.parametrize("bad", [
    "__import__('os')", "2 ** 10", "abc", "", "   ", "1 +", "(1 + 2", "1 + 2)", "1 / 0",
    "1 / (2 - 2)", "1e5", "1" * 201, "(" * 30 + "1" + ")" * 30, "4 % 2", "[1]",
])
def test_evaluate_expression_rejects_anything_else(bad):
    with pytest.raises(ValueError):
        evaluate_expression(bad)


def _expressions():
    leaf = st.integers(0, 10**6).map(str)
    return st.recursive(leaf, lambda e: st.tuples(e, st.sampled_from("+-*/"), e).map(
        lambda t: f"({t[0]} {t[1]} {t[2]})"), max_leaves=8)


@settings(max_examples=200, deadline=None)
@given(_expressions())
def test_evaluate_expression_equals_exact_rational_eval(expression):
    # Independent reference: Python evaluates the same generated expression over Fractions.
    reference_text = re.sub(r"(\d+)", r"Fraction(\1)", expression)
    try:
        reference = eval(reference_text, {"Fraction": Fraction})  # test-generated text only
    except ZeroDivisionError:
        with pytest.raises(ValueError, match="division by zero"):
            evaluate_expression(expression)
        return
    assert evaluate_expression(expression) == reference


@settings(max_examples=300, deadline=None)
@given(st.text(max_size=120))
def test_evaluate_expression_raises_only_value_error(text):
    try:
        evaluate_expression(text)
    except ValueError:
        pass


def test_oracle_solves_256_seeds_with_one_call_each():
    factory = make_python_env("calculator")
    assert "calculator" in registered_python_envs()
    for seed in range(256):
        env = factory(EpisodeSpec(seed=seed, group_id=0, member=0), 0)
        last, steps = play(env, CalculatorOracle().reply, seed)
        assert last.success and last.reward == 1.0, (seed, env.question)
        assert [s.tool_calls for s in steps] == [1, 0] and sum(s.tool_errors for s in steps) == 0


def test_problems_are_seeded_and_need_the_tool():
    factory = make_python_env("calculator", operations=2)
    a = factory(EpisodeSpec(5, 0, 0), 0)
    b = factory(EpisodeSpec(5, 0, 1), 0)
    c = factory(EpisodeSpec(5, 0, 0), 1)
    assert a.reset(5) == b.reset(5) != c.reset(5)  # same seed, same problem; run seed matters
    for seed in range(64):
        env = factory(EpisodeSpec(seed, 0, 0), 0)
        env.reset(seed)
        numbers = [int(n) for n in re.findall(r"\d+", env.question)]
        assert len(numbers) == 3 and env.answer > 0 and env.answer == int(env.answer)
        assert env.answer >= 100  # no answer a glance gives


def test_answers_are_compared_as_numbers():
    env = make_python_env("calculator")(EpisodeSpec(0, 0, 0), 0)
    env.reset(0)
    assert env.is_correct(f"{env.answer:,}", env.answer)
    assert env.is_correct(f" {env.answer}.0 ", env.answer)
    assert not env.is_correct(str(env.answer + 1), env.answer)
    assert not env.is_correct("1e999999", env.answer) and not env.is_correct("", env.answer)


def test_the_warmup_policy_writes_only_well_formed_calls():
    policy_rng = random.Random(0)
    factory = make_python_env("calculator", operations=0)
    solved = 0
    for seed in range(64):
        env = factory(EpisodeSpec(seed, 0, 0), 0)
        last, steps = play(env, random_calculator_policy(policy_rng), seed)
        assert sum(s.tool_errors for s in steps) == 0 and last.terminated
        solved += last.success
    assert 0 < solved < 64  # random operators: sometimes right, not always


def test_the_warmup_policy_copies_the_numbers_in_order_and_guesses_only_the_operator():
    # One-operation problems: the expression is "a op b" in the problem's order, so the
    # policy is right exactly when its random operator is (1 in 4), never by number order.
    factory = make_python_env("calculator", operations=1)
    policy_rng, solved, episodes = random.Random(1), 0, 400
    for seed in range(episodes):
        env = factory(EpisodeSpec(seed, 0, 0), 0)
        text = env.reset(seed)
        call = random_calculator_policy(policy_rng)(text)
        expression = re.search(r'"expression": "([^"]*)"', call).group(1)
        problem = re.search(r"Problem: (.*)", text).group(1)
        assert re.findall(r"\d+", expression) == re.findall(r"\d+", problem)
        right = evaluate_expression(expression) == evaluate_expression(env.expression)
        solved += right
    assert abs(solved / episodes - 0.25) < 0.07  # binomial sd ~0.022


@pytest.mark.parametrize("call_style", ["qwen", "compact"])
def test_oracle_and_warmup_policy_write_the_call_style_asked_for(call_style):
    # Qwen2.5's template asks for "<tool_call>\n{…}\n</tool_call>"; the hint, the oracle and
    # the warm-up policy follow the env's call_style.
    env = make_python_env("calculator", call_style=call_style)(EpisodeSpec(0, 0, 0), 0)
    text = env.reset(0)
    newline = call_style == "qwen"
    for reply in (CalculatorOracle(call_style).reply(text),
                  random_calculator_policy(random.Random(0), call_style)(text)):
        assert reply.startswith("<tool_call>\n" if newline else "<tool_call>{"), reply
        assert reply.endswith("\n</tool_call>" if newline else "}</tool_call>"), reply
    hint = env.step("no idea").observation
    assert ("<tool_call>\n{" in hint) == newline


def test_bad_config_fails_when_the_factory_is_made():
    with pytest.raises(ValueError, match="operations"):
        make_python_env("calculator", operations=3)


@pytest.mark.parametrize("operations", [1, 2])
def test_two_digit_problems_give_small_numbers_and_whole_answers(operations):
    from jaxrl_agentic.envs.calculator import make_problem

    rng = random.Random(0)
    for _ in range(500):
        text, expression, answer = make_problem(rng, operations, "two_digit")
        given = [int(n) for n in re.findall(r"\d+", text)]
        assert given == [int(n) for n in re.findall(r"\d+", expression)]
        # a divisor and a product's last factor are 2-9; every other number 10-99
        small = {int(n) for n in re.findall(r"[/*] (\d+)", expression)}
        for n in given:
            assert 10 <= n <= 99 or (n in small and 2 <= n <= 9)
        assert evaluate_expression(expression) == answer > 0
        if operations == 1:  # at most three digits to copy from the result
            assert answer < 1000


def test_an_unknown_number_size_fails_when_the_factory_is_made():
    with pytest.raises(ValueError, match="number_size"):
        make_python_env("calculator", number_size="huge")
