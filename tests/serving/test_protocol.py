"""The chat-completions wire format: what a request may hold, and how a reply's tool calls
come back in OpenAI's form."""

import json

import pytest

from jaxrl_agentic.envs.tools import format_tool_call
from jaxrl_agentic.serving.protocol import (
    RequestError,
    assistant_message,
    canonical_message,
    completion_body,
    parse_chat_request,
)

USER = [{"role": "user", "content": "hi"}]


@pytest.mark.parametrize("body, param, code", [
    ({"messages": USER, "n": 2}, "n", "unsupported_value"),
    ({"messages": USER, "stream": True}, "stream", "unsupported_value"),
    ({"messages": []}, "messages", "invalid_value"),
    ({"messages": [{"role": "robot", "content": "x"}]}, "messages[0].role", "invalid_value"),
    ({"messages": USER, "tool_choice": "required"}, "tool_choice", "unsupported_value"),
    ({"messages": USER, "max_tokens": 0}, "max_tokens", "invalid_value"),
    ({"messages": USER, "temperature": -1}, "temperature", "invalid_value"),
    ({"messages": USER, "top_p": 0}, "top_p", "invalid_value"),
    ({"messages": USER, "stop": ["a", "b", "c", "d", "e"]}, "stop", "invalid_value"),
    ({"messages": USER, "top_logprobs": 3}, "top_logprobs", "unsupported_value"),
    ({"messages": USER, "tools": [{"type": "function"}]}, "tools", "invalid_value"),
    ({"messages": [{"role": "user", "content": [{"type": "image_url"}]}]},
     "messages[0].content", "unsupported_value"),
])
def test_bad_requests_name_the_field(body, param, code):
    with pytest.raises(RequestError) as e:
        parse_chat_request(body)
    assert e.value.status == 400
    error = e.value.body()["error"]
    assert (error["param"], error["code"], error["type"]) == (param, code,
                                                               "invalid_request_error")
    assert error["message"].startswith(param)


def test_a_full_request_is_read():
    tools = [{"type": "function", "function": {"name": "add", "parameters": {}}}]
    request = parse_chat_request({
        "model": "m", "messages": [{"role": "developer", "content": [
            {"type": "text", "text": "be "}, {"type": "text", "text": "brief"}]}] + USER,
        "tools": tools, "max_completion_tokens": 5, "temperature": 0.5, "top_p": 0.9,
        "stop": "END", "logprobs": True, "seed": 3, "presence_penalty": 0})
    assert request.messages == ({"role": "system", "content": "be brief"},
                                {"role": "user", "content": "hi"})
    assert request.tools == tuple(tools)
    assert (request.max_tokens, request.temperature, request.top_p, request.stop,
            request.logprobs, request.tool_choice) == (5, 0.5, 0.9, ("END",), True, "auto")


def test_tool_calls_come_back_in_openai_form_and_compare_as_sent():
    text = "Let me add. " + format_tool_call("add", {"a": 1, "b": 2}) + \
        format_tool_call("neg", {"x": 3}, call_style="compact")
    message = assistant_message(text, "auto", "call_7")
    assert message["content"] == "Let me add."
    assert [(c["id"], c["function"]["name"], json.loads(c["function"]["arguments"]))
            for c in message["tool_calls"]] == [("call_7_0", "add", {"a": 1, "b": 2}),
                                                ("call_7_1", "neg", {"x": 3})]
    body = completion_body(completion_id="c", model="m", message=message, stop_reason="eos",
                           prompt_tokens=10, token_texts=None, logprobs=[-0.5, -1.0])
    assert body["choices"][0]["finish_reason"] == "tool_calls"
    assert body["usage"] == {"prompt_tokens": 10, "completion_tokens": 2, "total_tokens": 12}
    # What an SDK writes back (arguments spelled otherwise, null fields) is the same message.
    echoed = {"role": "assistant", "content": "Let me add.", "refusal": None, "tool_calls": [
        {"id": "call_7_0", "type": "function",
         "function": {"name": "add", "arguments": '{"b": 2, "a": 1}'}},
        {"id": "call_7_1", "type": "function",
         "function": {"name": "neg", "arguments": {"x": 3}}}]}
    assert canonical_message(echoed, 1) == canonical_message(message, 1)
    # tool_choice "none", or a garbled call: the text comes back as it is, no calls.
    assert assistant_message(text, "none", "c") == {"role": "assistant", "content": text}
    garbled = text + "<tool_call>{oops</tool_call>"
    assert assistant_message(garbled, "auto", "c") == {"role": "assistant",
                                                      "content": garbled}
