"""Tool calls: parsing (hand cases and a fuzz test), execution, errors, timeouts, metrics."""

import dataclasses
import json
import threading

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from jaxrl_agentic.envs.tools import (
    CALL_CLOSE,
    CALL_OPEN,
    ERROR_KINDS,
    Tool,
    ToolCall,
    ToolEnv,
    check_arguments,
    format_tool_call,
    parse_answer,
    parse_tool_calls,
    run_tool_call,
    tool_episode_metrics,
    tool_metrics,
    tool_response_text,
    tool_responses,
)

ADD = Tool("add", "Add two integers.", {
    "type": "object", "properties": {"a": {"type": "integer"}, "b": {"type": "integer"}},
    "required": ["a", "b"]}, fn=lambda a, b: str(a + b))


def _call(obj) -> str:
    return f"{CALL_OPEN}{json.dumps(obj)}{CALL_CLOSE}"


class Adder(ToolEnv):
    """A task for the tests: the answer is 7, known only through `add`."""

    def __init__(self, extra_tools=(), **kw):
        super().__init__([ADD, *extra_tools], **kw)

    def new_task(self, seed):
        return "Question: what is 3 + 4?", 7


def test_parse_tool_calls_hand_cases():
    reply = ('think <tool_call>{"name": "add", "arguments": {"a": 1, "b": 2}}</tool_call>'
             '<tool_call> {"name": "add", "arguments": "{\\"a\\": 5, \\"b\\": 6}"} </tool_call>'
             "<tool_call>{oops}</tool_call><tool_call>[1]</tool_call>"
             '<tool_call>{"arguments": {}}</tool_call><tool_call>{"name": "add", "x": 1}'
             "</tool_call><tool_call>{\"name\": \"add\"")
    calls = parse_tool_calls(reply)
    assert calls[0] == ToolCall("add", {"a": 1, "b": 2})
    assert calls[1] == ToolCall("add", {"a": 5, "b": 6})  # arguments as a JSON string
    assert [c.error is not None for c in calls] == [False, False, True, True, True, True, True]
    assert "unclosed" in calls[-1].error
    assert parse_tool_calls("no calls here") == [] and parse_tool_calls(None) == []


def test_parse_answer_takes_the_last_closed_answer():
    assert parse_answer("<answer> 12 </answer> <ANSWER>13</answer>") == "13"
    assert parse_answer("<answer>12") is None and parse_answer(7) is None


def test_check_arguments_follows_the_schema():
    assert check_arguments(ADD, {"a": 1, "b": 2}) is None
    assert "missing" in check_arguments(ADD, {"a": 1})
    assert "unknown" in check_arguments(ADD, {"a": 1, "b": 2, "c": 3})
    assert "integer" in check_arguments(ADD, {"a": 1.5, "b": 2})
    assert "integer" in check_arguments(ADD, {"a": True, "b": 2})  # JSON bool is not a number


def test_run_tool_call_turns_every_failure_into_an_error_message():
    tools = {"add": ADD, "boom": Tool("boom", "raises", {"type": "object", "properties": {}},
                                      fn=lambda: 1 / 0)}
    ok = run_tool_call(ToolCall("add", {"a": 2, "b": 3}), tools, timeout_s=5.0)
    assert ok.content == "5" and not ok.error
    assert run_tool_call(ToolCall("nope", {}), tools, 1.0).content.startswith(
        "Error: unknown tool 'nope'")
    assert run_tool_call(ToolCall(None, None, "bad JSON"), tools, 1.0).error
    boom = run_tool_call(ToolCall("boom", {}), tools, 1.0)
    assert boom.error and "division by zero" in boom.content and not boom.timeout


def test_a_call_past_its_timeout_is_an_error_and_a_timeout():
    release = threading.Event()
    hang = Tool("hang", "never returns in time", {"type": "object", "properties": {}},
                fn=lambda: release.wait() and "late")
    env = Adder(extra_tools=[hang], call_timeout_s=0.05, tool_error_penalty=0.25)
    env.reset(0)
    step = env.step(_call({"name": "hang", "arguments": {}}) +
                    _call({"name": "add", "arguments": {"a": 3, "b": 4}}))
    release.set()
    assert (step.tool_calls, step.tool_errors, step.tool_timeouts) == (2, 1, 1)
    assert step.tool_error_kinds == ("timeout",)
    assert "timed out" in step.tool_messages[0] and step.tool_messages[1] == "7"
    assert step.reward == -0.25 and not step.terminated and step.action_is_effective


def test_tool_env_rules():
    env = Adder(max_calls_per_turn=2, tool_error_penalty=0.1, format_penalty=0.3)
    first = env.reset(0)
    assert first.endswith("Question: what is 3 + 4?")
    h0 = env.state_hash()
    good = _call({"name": "add", "arguments": {"a": 3, "b": 4}})
    # three calls, limit two: the third is answered with an error and charged
    step = env.step(good * 3)
    assert step.tool_messages[:2] == ("7", "7") and "at most 2" in step.tool_messages[2]
    assert (step.tool_calls, step.tool_errors) == (3, 1) and abs(step.reward + 0.1) < 1e-12
    assert env.state_hash() != h0  # results seen are part of the state
    # neither a call nor an answer: format penalty and a user message
    step = env.step("I think it is seven")
    assert step.reward == -0.3 and step.observation and not step.tool_messages
    assert not step.action_is_valid and step.action == -1
    # an answer with a call in the same reply: the call is an error, the answer counts
    step = env.step(good + "<answer>7</answer>")
    assert step.terminated and step.success and step.tool_errors == 1
    assert abs(step.reward - 0.9) < 1e-12
    env.reset(0)
    wrong = env.step("<answer>8</answer>")
    assert wrong.terminated and not wrong.success and wrong.reward == 0.0


def test_the_tool_error_penalty_of_an_episode_is_bounded():
    # 40 garbled calls and a right answer: 0.1 each would be −4.0 against a +1 reward;
    # the episode pays at most max_tool_error_penalty (0.5 by default) in all.
    env = Adder(max_calls_per_turn=40)
    env.reset(0)
    garbled = f"{CALL_OPEN}{{oops}}{CALL_CLOSE}"
    first = env.step(garbled * 4)
    assert first.tool_errors == 4 and abs(first.reward + 0.4) < 1e-12
    second = env.step(garbled * 36)
    assert second.tool_errors == 36 and abs(second.reward + 0.1) < 1e-12  # 0.5 reached
    last = env.step(garbled + "<answer>7</answer>")
    assert last.success and last.tool_errors == 1 and last.reward == 1.0
    # A new episode starts with nothing paid; the bound is a setting.
    env.reset(1)
    assert abs(env.step(garbled * 2).reward + 0.2) < 1e-12
    strict = Adder(max_calls_per_turn=40, max_tool_error_penalty=2.0)
    strict.reset(0)
    assert abs(strict.step(garbled * 30).reward + 2.0) < 1e-12


def test_calls_are_written_in_qwens_form_and_parsed_in_both():
    # Qwen2.5's template asks for the JSON on a line of its own between the tags.
    qwen = format_tool_call("calculate", {"expression": "37 * 48"})
    assert qwen == ('<tool_call>\n{"name": "calculate", "arguments": {"expression": '
                    '"37 * 48"}}\n</tool_call>')
    compact = format_tool_call("calculate", {"expression": "37 * 48"}, "compact")
    assert compact == qwen.replace("\n", "")
    for reply in (qwen, compact):
        assert parse_tool_calls(reply) == [ToolCall("calculate", {"expression": "37 * 48"})]
    env = Adder()
    env.reset(0)
    assert format_tool_call("NAME", {"ARGUMENT": "VALUE"}) in env.step("seven?").observation


def test_tool_responses_inverts_tool_response_text():
    contents = ["7", "line one\nline two", "Error: x."]
    assert tool_responses(tool_response_text(contents)) == contents


def test_tool_metrics_aggregate_over_episodes():
    episodes = [{"tool/calls": 3.0, "tool/errors": 1.0, "tool/timeouts": 1.0,
                 "tool/errors_timeout": 1.0, "tool/turns_to_answer": 4.0},
                {"tool/calls": 1.0, "tool/errors": 0.0, "tool/timeouts": 0.0,
                 "tool/turns_to_answer": 2.0},
                {"tool/calls": 0.0, "tool/errors": 0.0, "tool/timeouts": 0.0},
                {"success": 1.0}]  # an episode of a non-tool env: left out
    zeros = {f"env/tool/errors_{k}": 0.0 for k in ERROR_KINDS}
    assert tool_metrics(episodes, "env/") == {
        **zeros, "env/tool/errors_timeout": 1.0,
        "env/tool/calls": 4.0, "env/tool/errors": 1.0, "env/tool/timeouts": 1.0,
        "env/tool/calls_per_episode": 4 / 3, "env/tool/valid_fraction": 0.75,
        "env/tool/answered": 2 / 3, "env/tool/turns_to_answer": 3.0}
    assert "tool/turns_to_answer" not in tool_metrics([episodes[2]])
    assert tool_metrics([{"success": 1.0}]) == {}


def test_every_erroneous_call_is_counted_by_its_kind():
    boom = Tool("boom", "raises", {"type": "object", "properties": {}}, fn=lambda: 1 / 0)
    env = Adder(extra_tools=[boom], max_calls_per_turn=4, max_tool_error_penalty=10.0)
    env.reset(0)
    steps = [env.step(f"{CALL_OPEN}{{oops}}{CALL_CLOSE}"                       # format
                      + _call({"name": "nope", "arguments": {}})               # unknown_tool
                      + _call({"name": "add", "arguments": {"a": "3"}})        # arguments
                      + _call({"name": "boom", "arguments": {}})               # tool
                      + _call({"name": "add", "arguments": {"a": 3, "b": 4}})),  # over_limit
             env.step(_call({"name": "add", "arguments": {"a": 3, "b": 4}})),  # fine
             env.step(_call({"name": "add", "arguments": {"a": 3, "b": 4}})
                      + "<answer>7</answer>")]                                # with_answer
    assert steps[0].tool_error_kinds == ("format", "unknown_tool", "arguments", "tool",
                                         "over_limit")
    assert steps[1].tool_error_kinds == () and steps[2].tool_error_kinds == ("with_answer",)
    metrics = tool_episode_metrics(steps)
    assert {k: metrics[f"tool/errors_{k}"] for k in ERROR_KINDS} == {
        "format": 1.0, "unknown_tool": 1.0, "arguments": 1.0, "tool": 1.0, "timeout": 0.0,
        "over_limit": 1.0, "with_answer": 1.0}
    assert metrics["tool/errors"] == 6.0 and metrics["tool/turns_to_answer"] == 3.0


_FRAGMENTS = st.sampled_from([
    CALL_OPEN, CALL_CLOSE, "<answer>", "</answer>", "{", "}", "[", "]", '"', ":", ",",
    '"name"', '"arguments"', '"add"', '"a"', '"b"', "1", "-2.5e3", "null", "true", "\\",
    "\n", " ", "é", "\x00", "[" * 50, "9" * 5000])


@settings(max_examples=300, deadline=None)
@given(st.one_of(st.text(max_size=300), st.lists(_FRAGMENTS, max_size=40).map("".join)))
def test_fuzz_parsing_and_stepping_never_raise(reply):
    calls = parse_tool_calls(reply)
    closed = 0
    pos = 0
    while (start := reply.find(CALL_OPEN, pos)) >= 0:  # count blocks independently
        end = reply.find(CALL_CLOSE, start + len(CALL_OPEN))
        closed += 1
        if end < 0:
            break
        pos = end + len(CALL_CLOSE)
    assert len(calls) == closed  # every block is a call, garbled or not: none is lost
    env = Adder(max_calls_per_turn=3)
    env.reset(0)
    step = env.step(reply)
    assert step.tool_calls == len(calls) and 0 <= step.tool_errors <= step.tool_calls
    if parse_answer(reply) is None and calls:
        assert len(step.tool_messages) == len(calls)
        errors = sum(m.startswith("Error:") for m in step.tool_messages)
        assert errors == step.tool_errors


def test_deeply_nested_json_is_a_garbled_call_not_a_crash():
    calls = parse_tool_calls(CALL_OPEN + "[" * 100_000 + CALL_CLOSE)
    assert len(calls) == 1 and calls[0].error


def test_a_tool_that_returns_no_str_ends_the_episode_as_an_environment_error():
    """`Tool.fn` returns the tool message: anything else (a number, a forgotten `return`)
    is the tool's bug, not the model's. It is neither converted with `str` nor charged as a
    tool error: it raises out of `step`, and the runner ends the episode as an environment
    error (`env/errors`), as for any step that raises."""
    from jaxrl_agentic.envs.tools import ToolResultTypeError, ToolUnavailableError

    number = Tool("number", "returns an int", {"type": "object", "properties": {}},
                  fn=lambda: 7)
    nothing = Tool("nothing", "returns None", {"type": "object", "properties": {}},
                   fn=lambda: None)
    tools = {"number": number, "nothing": nothing}
    for timeout_s in (0.0, 5.0):  # called inline, and on its own thread
        with pytest.raises(ToolResultTypeError, match="tool 'number' returned int, not str"):
            run_tool_call(ToolCall("number", {}), tools, timeout_s)
        with pytest.raises(ToolUnavailableError, match="tool 'nothing' returned NoneType"):
            run_tool_call(ToolCall("nothing", {}), tools, timeout_s)
    env = Adder(extra_tools=[number])
    env.reset(0)
    with pytest.raises(ToolUnavailableError, match="'number' returned int"):
        env.step(_call({"name": "number", "arguments": {}}))
    assert env.step(_call({"name": "add", "arguments": {"a": 3, "b": 4}})).tool_messages == (
        "7",)  # a str result, as before


def test_registering_the_same_tool_again_is_a_no_op_and_another_one_an_error():
    """A recipe runs again each time its config is read (the override check reads it
    twice): the same definition registered again changes nothing; another tool under the
    name is still refused unless `replace=True`."""
    from jaxrl_agentic.envs.tools import get_tool, register_tool

    def make(description="Echo the text."):
        def echo(text: str) -> str:
            return text

        return Tool("test_echo_again", description, {
            "type": "object", "properties": {"text": {"type": "string"}},
            "required": ["text"]}, fn=echo)

    first = make()
    register_tool(first)
    try:
        register_tool(make())  # new objects, the same definition: a no-op
        assert get_tool("test_echo_again") is first
        with pytest.raises(ValueError, match="already registered"):
            register_tool(make("Echo it louder."))
        with pytest.raises(ValueError, match="already registered"):
            register_tool(dataclasses.replace(first, fn=lambda text: text))
        assert get_tool("test_echo_again") is first
        louder = make("Echo it louder.")
        register_tool(louder, replace=True)
        assert get_tool("test_echo_again") is louder
    finally:
        from jaxrl_agentic.envs import tools as tools_module

        tools_module._TOOLS.pop("test_echo_again", None)
