"""The OpenAI chat-completions wire format: requests checked, replies and errors written.

A request is checked field by field; what the endpoint cannot honour is a 400 with
OpenAI's error body, naming the field, never silently ignored:

    {"error": {"message": "...", "type": "invalid_request_error", "param": "n",
               "code": "unsupported_value"}}

Supported: ``messages`` (roles system/developer, user, assistant with ``tool_calls``, tool;
content a string or a list of text parts), ``tools`` (OpenAI function format, handed to the
chat template), ``tool_choice`` ``"auto"`` / ``"none"``, ``max_tokens`` /
``max_completion_tokens``, ``temperature``, ``top_p``, ``stop``, ``n`` = 1, ``logprobs``
(the sampled token's; ``top_logprobs`` 0). Other fields (``model``, ``seed``, ``user``,
penalties, ...) are accepted and do not change the reply.

A reply's text is parsed with the project's tool-call parser (`envs.tools.parse_tool_calls`,
Qwen's ``<tool_call>{"name": ..., "arguments": {...}}</tool_call>`` blocks): well-formed
calls come back as OpenAI ``tool_calls`` (arguments as a JSON string) with
``finish_reason="tool_calls"``, and the message content is the text around them.
"""

from __future__ import annotations

import dataclasses
import json
import math
import time
from collections.abc import Sequence
from typing import Any

from jaxrl_agentic.envs.tools import CALL_CLOSE, CALL_OPEN, parse_tool_calls

ROLES = ("system", "developer", "user", "assistant", "tool")
MAX_STOP_STRINGS = 4


class RequestError(Exception):
    """A request the endpoint answers with an OpenAI error body (`error_body`)."""

    def __init__(self, status: int, message: str, *, param: str | None = None,
                 code: str | None = None, kind: str = "invalid_request_error"):
        super().__init__(message)
        self.status, self.message, self.param, self.code, self.kind = (
            status, message, param, code, kind)

    def body(self) -> dict:
        return {"error": {"message": self.message, "type": self.kind, "param": self.param,
                          "code": self.code}}


def _bad(param: str, message: str, code: str = "invalid_value") -> RequestError:
    return RequestError(400, f"{param}: {message}", param=param, code=code)


@dataclasses.dataclass(frozen=True)
class ChatRequest:
    """A checked chat-completions request (messages as `canonical_message` dicts)."""

    messages: tuple[dict, ...]
    tools: tuple[dict, ...] | None
    tool_choice: str  # "auto" | "none"
    max_tokens: int | None
    temperature: float | None
    top_p: float | None
    stop: tuple[str, ...]
    logprobs: bool
    model: str


def _text(content, param: str) -> str:
    """A message's content as one string (a list of text parts joined)."""
    if content is None:
        return ""
    if isinstance(content, str):
        return content
    if isinstance(content, list):
        parts = []
        for part in content:
            if not (isinstance(part, dict) and part.get("type") == "text"
                    and isinstance(part.get("text"), str)):
                raise _bad(param, "only text content parts ({'type': 'text', 'text': ...}) "
                           "are supported", "unsupported_value")
            parts.append(part["text"])
        return "".join(parts)
    raise _bad(param, f"must be a string or a list of text parts, got "
               f"{type(content).__name__}")


def _arguments(value, param: str) -> str:
    """Tool-call arguments in one canonical JSON spelling (so two spellings of the same
    object compare equal)."""
    if isinstance(value, str):
        try:
            value = json.loads(value)
        except ValueError:
            raise _bad(param, "is not a JSON string") from None
    if not isinstance(value, dict):
        raise _bad(param, "must be a JSON object")
    return json.dumps(value, sort_keys=True, ensure_ascii=False)


def canonical_message(message, index: int) -> dict:
    """`message` reduced to what the chat template renders and a continuation is compared
    on: role, content text, (assistant) tool calls' names and arguments, (tool) the call id.
    Extra keys an SDK writes back (``refusal``, ``annotations``, null fields) drop out."""
    param = f"messages[{index}]"
    if not isinstance(message, dict):
        raise _bad(param, "must be an object")
    role = message.get("role")
    if role not in ROLES:
        raise _bad(f"{param}.role", f"must be one of {', '.join(ROLES)}, got {role!r}")
    out = {"role": "system" if role == "developer" else role,
           "content": _text(message.get("content"), f"{param}.content")}
    if role == "assistant" and message.get("tool_calls"):
        calls = message["tool_calls"]
        if not isinstance(calls, list):
            raise _bad(f"{param}.tool_calls", "must be a list")
        out["tool_calls"] = []
        for k, call in enumerate(calls):
            where = f"{param}.tool_calls[{k}]"
            function = call.get("function") if isinstance(call, dict) else None
            if not isinstance(function, dict) or not isinstance(function.get("name"), str):
                raise _bad(where, "must be {'type': 'function', 'function': {'name', "
                           "'arguments'}}")
            out["tool_calls"].append({"name": function["name"], "arguments": _arguments(
                function.get("arguments", "{}"), f"{where}.function.arguments")})
    if role == "tool":
        out["tool_call_id"] = str(message.get("tool_call_id", ""))
    return out


def _number(body: dict, name: str, low: float, high: float, low_open: bool = False):
    value = body.get(name)
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(
            value) or value > high or value < low or (low_open and value == low):
        bound = "(" if low_open else "["
        raise _bad(name, f"must be a number in {bound}{low}, {high}], got {value!r}")
    return float(value)


def parse_chat_request(body: Any) -> ChatRequest:
    """A `ChatRequest` from a decoded JSON body; `RequestError` (400) naming the field."""
    if not isinstance(body, dict):
        raise RequestError(400, "the request body must be a JSON object")
    messages = body.get("messages")
    if not isinstance(messages, list) or not messages:
        raise _bad("messages", "must be a non-empty list")
    n = body.get("n", 1)
    if n != 1 or isinstance(n, bool):
        raise _bad("n", f"only n=1 is supported (one reply per request), got {n!r}",
                   "unsupported_value")
    if body.get("stream"):
        raise _bad("stream", "streaming is not supported", "unsupported_value")
    tools = body.get("tools")
    if tools is not None:
        if not isinstance(tools, list) or not all(
                isinstance(t, dict) and t.get("type", "function") == "function"
                and isinstance(t.get("function"), dict)
                and isinstance(t["function"].get("name"), str) for t in tools):
            raise _bad("tools", "must be a list of {'type': 'function', 'function': "
                       "{'name', 'description', 'parameters'}}")
        tools = tuple({"type": "function", "function": t["function"]} for t in tools) or None
    tool_choice = body.get("tool_choice") or "auto"
    if tool_choice not in ("auto", "none"):
        raise _bad("tool_choice", f"only 'auto' and 'none' are supported (decoding is not "
                   f"constrained), got {tool_choice!r}", "unsupported_value")
    max_tokens = body.get("max_completion_tokens", body.get("max_tokens"))
    if max_tokens is not None and (isinstance(max_tokens, bool) or not isinstance(
            max_tokens, int) or max_tokens < 1):
        raise _bad("max_tokens", f"must be an integer >= 1, got {max_tokens!r}")
    stop = body.get("stop")
    stop = () if stop is None else (stop,) if isinstance(stop, str) else stop
    if not isinstance(stop, (list, tuple)) or len(stop) > MAX_STOP_STRINGS or not all(
            isinstance(s, str) and s for s in stop):
        raise _bad("stop", f"must be a string or a list of at most {MAX_STOP_STRINGS} "
                   f"non-empty strings, got {body.get('stop')!r}")
    if body.get("top_logprobs"):
        raise _bad("top_logprobs", "only the sampled token's logprob is returned "
                   "(top_logprobs 0)", "unsupported_value")
    model = body.get("model", "")
    return ChatRequest(
        messages=tuple(canonical_message(m, i) for i, m in enumerate(messages)),
        tools=tools, tool_choice=tool_choice, max_tokens=max_tokens,
        temperature=_number(body, "temperature", 0.0, 2.0),
        top_p=_number(body, "top_p", 0.0, 1.0, low_open=True), stop=tuple(stop),
        logprobs=bool(body.get("logprobs")), model=model if isinstance(model, str) else "")


def assistant_message(text: str, tool_choice: str, call_id_prefix: str) -> dict:
    """The OpenAI assistant message of a reply `text`: its well-formed tool calls as
    ``tool_calls`` (unless tool_choice is "none") and the text around them as content
    (None when empty and there are calls). A garbled call stays in the content, as text."""
    calls = [] if tool_choice == "none" else parse_tool_calls(text)
    if not calls or any(c.error is not None for c in calls):
        return {"role": "assistant", "content": text}
    content, pos = [], 0
    while (start := text.find(CALL_OPEN, pos)) >= 0:
        content.append(text[pos:start])
        pos = text.index(CALL_CLOSE, start) + len(CALL_CLOSE)
    content = ("".join(content) + text[pos:]).strip()
    return {"role": "assistant", "content": content or None, "tool_calls": [
        {"id": f"{call_id_prefix}_{k}", "type": "function",
         "function": {"name": c.name, "arguments": json.dumps(c.arguments,
                                                              ensure_ascii=False)}}
        for k, c in enumerate(calls)]}


def finish_reason(message: dict, stop_reason: str) -> str:
    """OpenAI's finish_reason: tool_calls, length (the token budget ended it) or stop."""
    if message.get("tool_calls"):
        return "tool_calls"
    return "length" if stop_reason == "length" else "stop"


def completion_body(*, completion_id: str, model: str, message: dict, stop_reason: str,
                    prompt_tokens: int, token_texts: Sequence[str] | None,
                    logprobs: Sequence[float]) -> dict:
    """A ``chat.completion`` object; ``token_texts`` (None: logprobs not asked for) are the
    sampled tokens' texts, each with its sampled logprob."""
    choice = {"index": 0, "message": message,
              "finish_reason": finish_reason(message, stop_reason), "logprobs": None}
    if token_texts is not None:
        choice["logprobs"] = {"content": [
            {"token": t, "logprob": float(lp), "bytes": list(t.encode("utf-8")),
             "top_logprobs": []} for t, lp in zip(token_texts, logprobs, strict=True)]}
    completion_tokens = len(logprobs)
    return {"id": completion_id, "object": "chat.completion", "created": int(time.time()),
            "model": model, "choices": [choice],
            "usage": {"prompt_tokens": prompt_tokens, "completion_tokens": completion_tokens,
                      "total_tokens": prompt_tokens + completion_tokens}}


def models_body(model: str) -> dict:
    return {"object": "list", "data": [{"id": model, "object": "model", "created": 0,
                                        "owned_by": "jaxrl_agentic"}]}
