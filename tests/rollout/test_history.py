"""History policies (rollout/history.py): their message selection, hand-computed, the
registered functions, the whole-history rendering and the config errors."""

import pytest

from jaxrl_agentic.rollout.conversation import ChatFormatter
from jaxrl_agentic.rollout.history import (
    TOOL_OUTPUT_STUB,
    HistoryPolicy,
    parse_history,
    register_history_fn,
    split_turns,
)


def msg(role, content):
    return {"role": role, "content": content}


# [system] user_0 | a1 u1 | a2 t2 t2' | a3 u3   (turn 2 made two tool calls)
HISTORY = [msg("system", "S"), msg("user", "task"),
           msg("assistant", "a1"), msg("user", "o1"),
           msg("assistant", "a2"), msg("tool", "r2a"), msg("tool", "r2b"),
           msg("assistant", "a3"), msg("user", "o3")]


def test_turns_are_an_assistant_reply_and_the_answer_that_follows_it():
    head, turns = split_turns(HISTORY)
    assert head == HISTORY[:2]
    assert turns == [HISTORY[2:4], HISTORY[4:7], HISTORY[7:9]]


@pytest.mark.parametrize("k, kept", [
    (1, ["S", "task", "a3", "o3"]),
    (2, ["S", "task", "a2", "r2a", "r2b", "a3", "o3"]),
    (3, ["S", "task", "a1", "o1", "a2", "r2a", "r2b", "a3", "o3"]),
    (9, ["S", "task", "a1", "o1", "a2", "r2a", "r2b", "a3", "o3"]),
])
def test_window_keeps_the_head_and_the_last_k_turns(k, kept):
    out = parse_history(f"window:{k}")(HISTORY)
    assert [m["content"] for m in out] == kept
    assert out[0]["role"] == "system" and out[1]["role"] == "user"


def test_window_without_a_system_turn_keeps_the_first_user_message():
    history = HISTORY[1:]
    assert [m["content"] for m in parse_history("window:1")(history)] == ["task", "a3", "o3"]


@pytest.mark.parametrize("k, stubbed", [(0, {"r2a", "r2b"}), (1, {"r2a"}), (2, set()),
                                        (5, set())])
def test_drop_tool_outputs_stubs_all_but_the_last_k_tool_messages(k, stubbed):
    out = parse_history(f"drop_tool_outputs:{k}")(HISTORY)
    assert [m["role"] for m in out] == [m["role"] for m in HISTORY]
    for before, after in zip(HISTORY, out, strict=True):
        expected = TOOL_OUTPUT_STUB if before["content"] in stubbed else before["content"]
        assert after["content"] == expected
    assert HISTORY[5]["content"] == "r2a"  # the policy works on a copy


def test_a_registered_history_fn_rewrites_and_its_output_is_checked():
    def last_only(messages):
        return [m for m in messages if m["role"] != "assistant"][-1:]

    register_history_fn("test_last_only", last_only)
    register_history_fn("test_last_only", last_only)  # the same registration: no conflict
    policy = parse_history("test_last_only")
    assert policy == HistoryPolicy("test_last_only") and policy.rewrites
    assert policy(HISTORY) == [msg("user", "o3")]
    with pytest.raises(ValueError, match="already registered"):
        register_history_fn("test_last_only", lambda m: m)
    for bad, why in ((lambda m: "text", "not a non-empty list"),
                     (lambda m: m[:3], "ends with a user or tool message"),
                     (lambda m: m[2:], "starts with"),
                     (lambda m: [{"role": "user"}], "str content")):
        register_history_fn("test_bad", bad, replace=True)
        with pytest.raises(ValueError, match=why):
            parse_history("test_bad")(HISTORY)
    with pytest.raises(ValueError, match="not one of"):
        register_history_fn("window", last_only)


@pytest.mark.parametrize("value, why", [
    ("window:0", "window needs an integer k >= 1"),
    ("window:x", "window needs an integer k >= 1"),
    ("window", "window needs an integer k >= 1"),
    ("drop_tool_outputs:-1", "drop_tool_outputs needs an integer k >= 0"),
    ("sliding", "unknown policy 'sliding'"),
    ("full:2", "unknown policy"),
    (3, "must be a string"),
])
def test_bad_history_values_are_one_line_errors(value, why):
    with pytest.raises(ValueError, match=why) as e:
        parse_history(value)
    assert str(e.value).startswith("history: ") and "\n" not in str(e.value)


@pytest.mark.parametrize("value, why", [("window:0", "k >= 1"), ("window:x", "k >= 1"),
                                        ("summarise", "unknown policy 'summarise'")])
def test_bad_history_is_a_config_error_naming_the_field(value, why):
    from jaxrl_agentic.config import ConfigError, default_config, validate

    c = default_config()
    c.custom_envs.frozen_lake.history = value
    with pytest.raises(ConfigError, match=why) as e:
        validate(c)
    assert str(e.value).startswith("config.custom_envs.frozen_lake.history: ")
    assert "\n" not in str(e.value)
    c.custom_envs.frozen_lake.history = "window:3"
    validate(c)


def test_the_run_config_carries_the_parsed_policy():
    from jaxrl_agentic.config import default_config
    from jaxrl_agentic.run_config import build_run_config

    c = default_config()
    assert build_run_config(c).envs["frozen_lake"].history == HistoryPolicy("full")
    c.custom_envs.frozen_lake.history = "drop_tool_outputs:2"
    assert build_run_config(c).envs["frozen_lake"].history == HistoryPolicy(
        "drop_tool_outputs", 2)


@pytest.fixture(scope="module")
def tokenizer(tiny_model_dir):
    from jaxrl_agentic.models import load_pretrained

    return load_pretrained(tiny_model_dir)[1]


def test_history_prompt_renders_like_the_appended_stream(tokenizer):
    formatter = ChatFormatter(tokenizer, system_prompt="Play well.", reply_prefix="<answer>")
    assert formatter.history_prompt([msg("system", "Play well."), msg("user", "Go.")]) == \
        formatter.first_prompt("Go.")
    # The stream of a two-turn chat, appended piece by piece, and the same chat rendered
    # whole (the reply's text as the stream shows it: prefix + generated, closed by EOS).
    reply = formatter.encode("Left</answer>")
    stream = (formatter.first_prompt("Go.") + reply + [formatter.eos_token_id]
              + formatter.next_prompt("You moved."))
    whole = formatter.history_prompt([msg("system", "Play well."), msg("user", "Go."),
                                      msg("assistant", "<answer>Left</answer>"),
                                      msg("user", "You moved.")])
    assert tokenizer.decode(whole) == tokenizer.decode(stream)


def test_history_prompt_lists_tools_as_first_prompt_does(tokenizer):
    formatter = ChatFormatter(tokenizer)
    tools = [{"type": "function", "function": {"name": "lookup", "parameters": {}}}]
    assert formatter.history_prompt([msg("user", "Find it.")], tools=tools) == \
        formatter.first_prompt("Find it.", tools=tools)
    with_results = formatter.history_prompt(
        [msg("user", "Find it."), msg("assistant", "<tool_call>{}</tool_call>"),
         msg("tool", "42")], tools=tools)
    assert tokenizer.decode(with_results).startswith(
        tokenizer.decode(formatter.first_prompt("Find it.", tools=tools)))
    assert "42" in tokenizer.decode(with_results)
