"""`reasoning_gym:<dataset>`: items by seed, the dataset's own scores, format penalty, tools,
config errors. The references are datasets built directly by reasoning-gym."""

import ast
import pathlib
import re
import sys

import pytest
import reasoning_gym

import jaxrl_agentic.envs.reasoning_gym_env as rg_env
from jaxrl_agentic.envs.calculator import evaluate_expression, format_number
from jaxrl_agentic.envs.python_env import make_python_env
from jaxrl_agentic.envs.registry import declared_backend
from jaxrl_agentic.envs.tools import ToolEnv, format_tool_call, tool_response_text
from jaxrl_agentic.rollout.groups import EpisodeSpec

DATASETS = ("basic_arithmetic", "chain_sum", "leg_counting")
SMALL_ARITHMETIC = {"min_terms": 2, "max_terms": 3, "min_digits": 1, "max_digits": 2,
                    "operators": ["+", "-", "*"], "allow_parentheses": False}


def episode(name, seed, member=0, run_seed=0, **config):
    """(env, first message) of episode `seed` of `reasoning_gym:<name>`."""
    env = make_python_env(rg_env.PREFIX + name, **config)(
        EpisodeSpec(seed=seed, group_id=0, member=member), run_seed)
    return env, env.reset(seed)


def reference(name, seed, **dataset_config):
    """(dataset, item 0) built by reasoning-gym itself, with a size the env does not use."""
    data = reasoning_gym.create_dataset(name, seed=seed, size=7, **dataset_config)
    return data, data[0]


@pytest.mark.parametrize("name", DATASETS)
def test_first_message_is_the_question_of_the_seeds_item(name):
    for seed in (0, 1, 10, 123457):
        env, text = episode(name, seed, format_penalty=0.1)
        _, item = reference(name, seed)
        assert text.startswith(item["question"].rstrip())
        assert text.rstrip().endswith("<answer>ANSWER</answer>.")
        assert env.max_steps_in_episode == 2 and env.tool_schemas is None
    assert declared_backend(rg_env.PREFIX + name) == "python"


@pytest.mark.parametrize("name", DATASETS)
def test_rewards_are_the_datasets_own_scores(name):
    for seed in range(5):
        data, item = reference(name, seed)
        right = item["answer"]
        env, _ = episode(name, seed)
        step = env.step(f"<think>Easy.</think> <answer>{right}</answer>")
        assert (step.reward, step.success, step.terminated) == (1.0, True, True)
        assert step.action_is_valid and step.action == 0
        wrong = str(int(right) + 1)
        env, _ = episode(name, seed)
        step = env.step(f"<answer>{wrong}</answer>")
        assert step.reward == data.score_answer(wrong, item) < 1.0
        assert step.terminated and not step.success
        padded = f"{right} is my answer"  # partial credit, where the dataset gives it
        env, _ = episode(name, seed)
        step = env.step(f"<answer>{padded}</answer>")
        assert step.reward == pytest.approx(data.score_answer(padded, item)) and not step.success


def test_partial_credit_is_the_default_scorers_ratio():
    env, _ = episode("leg_counting", 2)
    assert env.answer == "146"
    step = env.step("<answer>146 legs in all</answer>")
    assert step.reward == pytest.approx(3 / 15) and not step.success


def test_a_reply_without_an_answer_pays_the_format_penalty_until_the_step_limit():
    env, _ = episode("chain_sum", 3, format_penalty=0.25)
    hashes = [env.state_hash()]
    step = env.step(f"The sum is {env.answer}.")
    assert (step.reward, step.terminated, step.success, step.action_is_valid) == (
        -0.25, False, False, False)
    assert "<answer>ANSWER</answer>" in step.observation and step.action == -1
    hashes.append(env.state_hash())
    step = env.step(f"<answer>{env.answer}</answer>")  # the second and last reply
    assert step.reward == 1.0 and step.success and step.terminated
    assert env.max_steps_in_episode == 2 and hashes[0] != hashes[1]


def test_items_depend_on_the_episode_seed_only():
    a, text_a = episode("basic_arithmetic", 6, member=0, run_seed=0)
    b, text_b = episode("basic_arithmetic", 6, member=3, run_seed=9)
    assert text_a == text_b and a.state_hash() == b.state_hash()
    texts = {episode("basic_arithmetic", seed)[1] for seed in range(32)}
    assert len(texts) == 32  # each seed its own question


def test_dataset_config_reaches_the_dataset():
    for seed in range(8):
        env, text = episode("basic_arithmetic", seed, dataset_config=SMALL_ARITHMETIC)
        _, item = reference("basic_arithmetic", seed, **SMALL_ARITHMETIC)
        assert text.startswith(item["question"]) and env.answer == item["answer"]
        numbers = re.findall(r"\d+", item["question"])
        assert 2 <= len(numbers) <= 3 and all(len(n) <= 2 for n in numbers)


def test_unknown_dataset_names_its_close_matches():
    with pytest.raises(ValueError, match="close matches: reasoning_gym:basic_arithmetic"):
        make_python_env("reasoning_gym:basic_arithmetc")
    with pytest.raises(ValueError, match="reasoning-gym's datasets: .*leg_counting"):
        make_python_env("reasoning_gym:no_such_thing_at_all")


@pytest.mark.parametrize("config, message", [
    ({"min_terms": 2}, r"unknown config key\(s\) min_terms.*go in dataset_config"),
    ({"dataset_config": {"min_terms": 0}}, "min_terms must be positive"),
    ({"dataset_config": {"nope": 1}}, r"unknown dataset_config key\(s\) nope.*max_digits"),
    ({"dataset_config": {"seed": 1}}, "may not set seed"),
    ({"max_steps_in_episode": 0}, "max_steps_in_episode"),
    ({"format_penalty": -1.0}, "format_penalty"),
    ({"tools": ("no_such_tool",)}, "unknown tool 'no_such_tool'"),
    ({"tools": ("calculate",), "call_style": "bad"}, "call_style"),
])
def test_bad_config_is_a_value_error_at_build_time(config, message):
    with pytest.raises(ValueError, match=message):
        make_python_env("reasoning_gym:basic_arithmetic", **config)


def test_missing_package_names_the_install_command(monkeypatch):
    monkeypatch.setitem(sys.modules, "reasoning_gym", None)  # `import reasoning_gym` fails
    with pytest.raises(ImportError, match=re.escape(
            "reasoning_gym:chain_sum needs the reasoning-gym package: pip install -e '.[envs]'")):
        rg_env.reasoning_gym_builder("chain_sum")


def test_the_module_imports_reasoning_gym_only_when_building():
    tree = ast.parse(pathlib.Path(rg_env.__file__).read_text(encoding="utf-8"))
    top = [n for n in tree.body if isinstance(n, ast.Import | ast.ImportFrom)]
    names = [a.name for n in top if isinstance(n, ast.Import) for a in n.names]
    names += [n.module for n in top if isinstance(n, ast.ImportFrom)]
    assert not any(name.startswith("reasoning_gym") for name in names)


def _calculator_policy(text: str) -> str:
    """Calls `calculate` on the expression of a basic_arithmetic question, then answers
    the tool's result."""
    results = re.findall(r"<tool_response>\n(.*?)\n</tool_response>", text, re.DOTALL)
    if results:
        return f"<answer>{results[-1]}</answer>"
    expression = re.search(r"Calculate (.*)\.", text).group(1)
    return format_tool_call("calculate", {"expression": expression})


def test_with_the_calculator_a_call_then_the_answer_solves_the_item():
    for seed in range(6):
        env, text = episode("basic_arithmetic", seed, tools=("calculate",),
                            dataset_config=SMALL_ARITHMETIC)
        _, item = reference("basic_arithmetic", seed, **SMALL_ARITHMETIC)
        assert isinstance(env, ToolEnv) and env.max_steps_in_episode == 4
        assert [s["function"]["name"] for s in env.tool_schemas] == ["calculate"]
        assert text.startswith(item["question"]) and "<answer>ANSWER</answer>" in text
        first_hash = env.state_hash()
        call = env.step(_calculator_policy(text))
        expression = re.search(r"Calculate (.*)\.", item["question"]).group(1)
        assert call.tool_messages == (format_number(evaluate_expression(expression)),)
        assert (call.tool_calls, call.tool_errors, call.terminated, call.reward) == (
            1, 0, False, 0.0)
        assert env.state_hash() != first_hash  # the result is part of the state
        answer = env.step(_calculator_policy(tool_response_text(call.tool_messages)))
        assert (answer.reward, answer.success, answer.terminated) == (1.0, True, True)
        assert call.tool_messages[0] == item["answer"]


def test_with_tools_a_wrong_answer_scores_the_dataset_score_and_no_tag_is_penalised():
    env, _ = episode("leg_counting", 2, tools=["calculate"], format_penalty=0.3)
    step = env.step("no answer here")
    assert step.reward == -0.3 and not step.terminated and "<answer>" in step.observation
    step = env.step("<answer>146 legs in all</answer>")
    assert step.reward == pytest.approx(3 / 15) and step.terminated and not step.success
    env, _ = episode("leg_counting", 2, tools=["calculate"])
    step = env.step("<answer>145</answer>")
    assert step.reward == 0.0 and not step.success


def test_the_warm_up_policy_answers_with_other_items_answers():
    import random

    from jaxrl_agentic.envs.reasoning_gym_env import another_items_answer_policy
    from jaxrl_agentic.envs.tools import parse_answer

    config = {"min_terms": 2, "max_terms": 2, "min_digits": 1, "max_digits": 1}
    reply = another_items_answer_policy("basic_arithmetic", config)(random.Random(0))
    answers = [parse_answer(reply("Calculate 4 - 1.")) for _ in range(30)]
    assert all(a is not None and a.lstrip("-").isdigit() for a in answers)
    assert len(set(answers)) >= 5  # not one fixed reply
    items = reasoning_gym.create_dataset("basic_arithmetic", seed=2**40, size=1, **config)
    first = another_items_answer_policy("basic_arithmetic", config)(_FixedRng(0))
    assert parse_answer(first("q")) == items[0]["answer"]


class _FixedRng:
    def __init__(self, value):
        self.value = value

    def randrange(self, n):
        return self.value


@pytest.mark.parametrize("model", ["tiny_tools_dir", "qwen_fixture_dir"])
def test_the_tool_warm_up_policy_calls_on_the_questions_expression_or_guesses(model, request):
    # With the calculator, the warm-up reads the question out of the rendered chat (tools
    # block and markup around it). About a third of its first replies call `calculate` on
    # the question's own expression, and then answer the result (right); the rest answer
    # another item's answer (right only by chance).
    import random

    import transformers

    from jaxrl_agentic.warmup import text_policy

    tokenizer = transformers.AutoTokenizer.from_pretrained(request.getfixturevalue(model))
    config = {"tools": ("calculate",), "call_style": "compact",
              "dataset_config": SMALL_ARITHMETIC | {"max_terms": 2}}
    make_policy = text_policy("reasoning_gym:basic_arithmetic", config)
    rng, calls, solved_by_calls, episodes = random.Random(0), 0, 0, 150
    for seed in range(episodes):
        env, text = episode("basic_arithmetic", seed, **config)
        chat = tokenizer.apply_chat_template(
            [{"role": "user", "content": text}], tools=env.tool_schemas, tokenize=False,
            add_generation_prompt=True)
        assert rg_env.tool_question(chat) == env.question
        policy = make_policy(rng)
        step = env.step(policy(chat))
        if step.tool_calls:
            calls += 1
            expression = re.search(r"Calculate (.*)\.", env.question).group(1)
            assert step.tool_messages == (format_number(evaluate_expression(expression)),)
            step = env.step(policy(tool_response_text(step.tool_messages)))
            solved_by_calls += step.success
        assert step.terminated
    assert solved_by_calls == calls and abs(calls / episodes - 1 / 3) < 0.12  # sd ~0.04


def test_the_expression_of_a_question_is_its_longest_arithmetic_run():
    expression = rg_env.question_expression
    assert expression("Calculate 13 - 92.") == "13 - 92"
    assert expression("What is 4 + 3 - 1 =") == "4 + 3 - 1"
    assert expression("Compute (3 + 4) * 2.") == "(3 + 4) * 2"
    assert expression("How many legs do 3 cats and 2 birds have?") is None
