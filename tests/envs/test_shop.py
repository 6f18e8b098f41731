"""`shop`: every question needs `lookup` then `calculate`; the oracle solves them in three
turns, and the answers agree with arithmetic on the shop's own price list."""

import random
import re

import pytest

from jaxrl_agentic.envs.python_env import make_python_env
from jaxrl_agentic.envs.shop import GOODS, QUESTIONS, ShopOracle, random_shop_policy
from jaxrl_agentic.envs.tools import parse_tool_calls, tool_response_text
from jaxrl_agentic.rollout.groups import EpisodeSpec


def _env(seed, **config):
    return make_python_env("shop", **config)(EpisodeSpec(seed, 0, 0), 0)


def _play(env, policy, seed):
    text, steps, replies = env.reset(seed), [], []
    for _ in range(env.max_steps_in_episode):
        reply = policy.reply(text) if hasattr(policy, "reply") else policy(text)
        replies.append(reply)
        steps.append(env.step(reply))
        if steps[-1].terminated:
            break
        text = tool_response_text(steps[-1].tool_messages) or steps[-1].observation
    return steps, replies


def _by_hand(question, shop):
    """The answer from the question's words and the price list, without the env's code."""
    item = next(one for one, many in GOODS if re.search(rf"\b({one}|{many})\b", question))
    n = int(re.search(r"\d+", question).group())
    price = shop[item]
    if "How much do" in question:
        return n * price
    if "How many coins are left" in question:
        return n - price
    return price + n


@pytest.mark.parametrize("style", ["qwen", "compact"])
def test_the_oracle_needs_both_tools_in_order_and_always_wins(style):
    for seed in range(150):
        env = _env(seed, call_style=style)
        steps, replies = _play(env, ShopOracle(style), seed)
        names = [c.name for r in replies for c in parse_tool_calls(r)]
        assert names == ["lookup", "calculate"] and len(steps) == 3
        assert steps[-1].success and steps[-1].reward == 1.0
        assert env.answer == _by_hand(env.question, env.shop)
        assert str(env.shop[parse_tool_calls(replies[0])[0].arguments["item"]]) in \
            steps[0].tool_messages[0]


def test_questions_cover_every_template_and_the_price_list_is_hidden():
    seen = set()
    for seed in range(60):
        env = _env(seed)
        first = env.reset(seed)
        seen.add(next(i for i, (q, _) in enumerate(QUESTIONS)
                      if q.split("{")[0] in env.question))
        assert all(f"{item}: " not in first for item in env.shop)
        assert env.answer > 0 and len(env.shop) == 8
    assert seen == {0, 1, 2}
    a, b = _env(5), _env(5)
    assert a.reset(5) == b.reset(5) and a.shop == b.shop


def test_lookup_takes_either_name_and_refuses_what_the_shop_does_not_sell():
    env = _env(0)
    env.reset(0)
    sold = sorted(env.shop)
    missing = next(one for one, _ in GOODS if one not in env.shop)
    many = dict(GOODS)[sold[0]]
    for name in (sold[0], many.upper()):
        step = env.step(f'<tool_call>{{"name": "lookup", "arguments": {{"item": "{name}"}}}}'
                        "</tool_call>")
        assert step.tool_messages == (f"{sold[0]}: {env.shop[sold[0]]} coins",)
    bad = env.step(f'<tool_call>{{"name": "lookup", "arguments": {{"item": "{missing}"}}}}'
                   "</tool_call>")
    assert bad.tool_error_kinds == ("tool",) and ", ".join(sold) in bad.tool_messages[0]
    guess = _env(0)
    guess.reset(0)
    assert not guess.step("<answer>1</answer>").success


def test_the_warm_up_policy_writes_both_calls_in_order():
    wins = 0
    for seed in range(60):
        env = _env(seed, call_style="compact")
        steps, replies = _play(env, random_shop_policy(random.Random(seed), "compact"), seed)
        assert [c.name for r in replies for c in parse_tool_calls(r)] == ["lookup", "calculate"]
        assert all(s.tool_errors == 0 for s in steps) and steps[-1].terminated
        wins += steps[-1].success
    assert 5 <= wins <= 40  # right by chance only: the operator is drawn at random


def test_groups_of_the_warm_up_policy_mix_wins_and_losses():
    """RL's signal once the warm-up writes its policy: the recipe's step, 8 questions × 4
    episodes with their own draws of order and operator. A group that mixes wins and losses
    has non-zero GRPO advantages (r − mean) / std; one that always fails has none."""
    mixed = 0
    for question in range(8):
        wins = [_play(_env(question, call_style="compact"),
                      random_shop_policy(random.Random(100 * question + member), "compact"),
                      question)[0][-1].success for member in range(4)]
        mixed += 0 < sum(wins) < 4
    assert mixed >= 4  # 7 of 8 with these draws
