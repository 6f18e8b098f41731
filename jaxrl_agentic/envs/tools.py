"""Tool-using environments on the Python backend: tools, tool-call parsing, `ToolEnv`.

A tool is a Python function plus its JSON schema (name, description, parameters), the
function-calling format of Qwen2.5/Qwen3 (and of OpenAI's API):

    Tool(name="calculate", description="...", parameters={"type": "object",
         "properties": {"expression": {"type": "string", "description": "..."}},
         "required": ["expression"]}, fn=calculate)

The chat template lists the schemas in the system prompt (`tool.schema`, passed as the
template's `tools`). A reply calls tools with one block per call, in Qwen2.5's form (its
chat template asks for the JSON on a line of its own; `format_tool_call`,
`call_style="qwen"`):

    <tool_call>
    {"name": "calculate", "arguments": {"expression": "347 * 12"}}
    </tool_call>

and ends the episode with `<answer>…</answer>`. `call_style="compact"` writes the block on
one line (the tiny model's template shows that form); the parser accepts both. The results
come back as `tool` messages, one per call in order (Qwen's template wraps each in
`<tool_response>…</tool_response>`).

Garbled calls are part of the game, never exceptions: bad JSON, an unclosed block, an
unknown tool, arguments that do not fit the schema, a tool that raised, a call past its
timeout, a call beyond `max_calls_per_turn`, a call in the same reply as the answer. Each
one is answered with an `Error: …` tool message, counted in the step's `tool_errors`
(`tool_timeouts` too for a timeout), and charged `tool_error_penalty`, up to
`max_tool_error_penalty` per episode: unbounded, 40 garbled calls would cost −4 against a
+1 task reward and swamp the group-normalised advantages of every episode beside it.
`parse_tool_calls` never raises, whatever the text.

A tool that cannot run for a reason that is not the call's (an MCP server that died and
could not be restarted: `mcp_tools.MCPServerError`) raises `ToolUnavailableError`, which
`ToolEnv.step` lets through: the rollout ends that episode as an environment error
(`env/errors`, `rollout/python_runner.py`), and the model is charged nothing for it. So does
a tool function that returns anything but a `str` (`ToolResultTypeError`, a subclass): the
tool's bug, which `str(...)` would hide (`None` from a forgotten `return` would reach the
model as the text "None").
"""

from __future__ import annotations

import dataclasses
import json
import re
import threading
from collections.abc import Callable, Mapping, Sequence
from typing import Any

from jaxrl_agentic.envs.base import INVALID_ACTION
from jaxrl_agentic.envs.parsing import ANSWER_TAG as _ANSWER  # one answer-tag rule for every env
from jaxrl_agentic.envs.python_env import PyStep, PythonTextEnv, text_state_hash
from jaxrl_agentic.registration import same_registration

CALL_OPEN, CALL_CLOSE = "<tool_call>", "</tool_call>"
CALL_STYLES = ("qwen", "compact")
RESPONSE_OPEN, RESPONSE_CLOSE = "<tool_response>", "</tool_response>"
# Tool messages longer than this are cut: a runaway result must not blow the context.
MAX_RESULT_CHARS = 2000

_JSON_TYPES: dict[str, tuple[type, ...]] = {
    "string": (str,), "integer": (int,), "number": (int, float), "boolean": (bool,),
    "object": (dict,), "array": (list,),
}


@dataclasses.dataclass(frozen=True)
class Tool:
    """A function the model may call. `fn(**arguments) -> str`; raising means a bad call
    (the message goes back to the model); returning anything but a `str` ends the episode
    as an environment error (`ToolResultTypeError`). `parameters` is a JSON schema of an
    object whose properties are flat JSON types (string, integer, number, boolean, object,
    array)."""

    name: str
    description: str
    parameters: Mapping[str, Any]
    fn: Callable[..., str]

    @property
    def schema(self) -> dict[str, Any]:
        """The entry of the chat template's `tools` list (OpenAI/Qwen function format)."""
        return {"type": "function", "function": {
            "name": self.name, "description": self.description,
            "parameters": json.loads(json.dumps(self.parameters))}}


_TOOLS: dict[str, Tool] = {}


def register_tool(tool: Tool, *, replace: bool = False) -> None:
    """Makes `tool` available by name: a tool environment's `extra_tools=("name", …)` adds
    it to the tools of every episode (schema in the system turn, calls routed to `fn`).

    Registering the same definition again (equal name, description and schema, `fn`
    defined in the same place: `registration.same_registration`; a recipe runs again each
    time its config is read) is a no-op that keeps the first; another tool under a
    registered name is a ValueError unless `replace=True`."""
    if not isinstance(tool, Tool):
        raise TypeError(f"register_tool takes a Tool, got {type(tool).__name__}")
    if tool.name in _TOOLS and not replace:
        if same_registration(_TOOLS[tool.name], tool):
            return
        raise ValueError(f"tool {tool.name!r} is already registered")
    _TOOLS[tool.name] = tool


def registered_tools() -> list[str]:
    return sorted(_TOOLS)


def get_tool(name: str) -> Tool:
    if name not in _TOOLS:
        raise ValueError(f"unknown tool {name!r}; registered: {', '.join(registered_tools())}")
    return _TOOLS[name]


class ToolUnavailableError(RuntimeError):
    """The tool cannot run, through no fault of the call (its server died, say). Not a tool
    error of the model: `run_tool_call` and `ToolEnv.step` raise it, and the episode ends as
    an environment error (module docstring)."""


class ToolResultTypeError(ToolUnavailableError, TypeError):
    """A tool function returned something other than `str`: a programming error of the
    tool, never converted and never charged to the model; the episode ends as an
    environment error, like any `ToolUnavailableError`."""


@dataclasses.dataclass(frozen=True)
class ToolCall:
    """One parsed `<tool_call>` block: `error` is None for a well-formed call."""

    name: str | None
    arguments: dict[str, Any] | None
    error: str | None = None


def format_tool_call(name: str, arguments: Mapping[str, Any], call_style: str = "qwen") -> str:
    """One `<tool_call>` block: the JSON on its own line ("qwen") or inline ("compact")."""
    if call_style not in CALL_STYLES:
        raise ValueError(f"call_style must be one of {CALL_STYLES}, got {call_style!r}")
    body = json.dumps({"name": name, "arguments": dict(arguments)}, ensure_ascii=False)
    if call_style == "qwen":
        return f"{CALL_OPEN}\n{body}\n{CALL_CLOSE}"
    return f"{CALL_OPEN}{body}{CALL_CLOSE}"


def parse_tool_calls(reply: str) -> list[ToolCall]:
    """Every `<tool_call>…</tool_call>` block of `reply`, in order; never raises.

    A block must hold one JSON object `{"name": str, "arguments": object}` (`arguments` may
    also be a JSON string that decodes to an object, as some chat APIs send it). A block
    that does not is a `ToolCall` with `error` set; so is an opening tag left unclosed at
    the end of the reply (generation ran out mid-call), so that it is counted, not lost.
    """
    if not isinstance(reply, str):
        return []
    calls, pos = [], 0
    while True:
        start = reply.find(CALL_OPEN, pos)
        if start < 0:
            return calls
        body_start = start + len(CALL_OPEN)
        end = reply.find(CALL_CLOSE, body_start)
        if end < 0:
            calls.append(ToolCall(None, None, "unclosed <tool_call> (no </tool_call>)"))
            return calls
        calls.append(_parse_call_body(reply[body_start:end]))
        pos = end + len(CALL_CLOSE)


def _parse_call_body(body: str) -> ToolCall:
    try:
        obj = json.loads(body)
    except Exception as exc:  # ValueError, RecursionError on deep nesting, int limits, ...
        return ToolCall(None, None, f"the call is not valid JSON ({type(exc).__name__})")
    if not isinstance(obj, dict):
        return ToolCall(None, None, "the call must be a JSON object with name and arguments")
    name, arguments = obj.get("name"), obj.get("arguments", {})
    if not isinstance(name, str) or not name:
        return ToolCall(None, None, 'the call has no "name" string')
    if isinstance(arguments, str):
        try:
            arguments = json.loads(arguments)
        except Exception:
            return ToolCall(name, None, '"arguments" is a string that is not JSON')
    if not isinstance(arguments, dict):
        return ToolCall(name, None, '"arguments" must be a JSON object')
    extra = sorted(set(obj) - {"name", "arguments"})
    if extra:
        return ToolCall(name, None, f"unexpected keys in the call: {', '.join(extra)}")
    return ToolCall(name, arguments)


def parse_answer(reply: str) -> str | None:
    """The text of the last closed `<answer>…</answer>` (any case), stripped; else None."""
    if not isinstance(reply, str):
        return None
    matches = _ANSWER.findall(reply)
    return matches[-1].strip() if matches else None


def check_arguments(tool: Tool, arguments: Mapping[str, Any]) -> str | None:
    """Why `arguments` do not fit `tool.parameters` (required, unknown, types), or None."""
    props = tool.parameters.get("properties", {})
    missing = [k for k in tool.parameters.get("required", ()) if k not in arguments]
    if missing:
        return f"missing argument(s) {', '.join(missing)} for {tool.name}"
    unknown = sorted(k for k in arguments if k not in props)
    if unknown:
        return f"unknown argument(s) {', '.join(unknown)} for {tool.name}"
    for key, value in arguments.items():
        spec = props[key]
        # A schema's "type" may be a list (["string", "null"]: servers in other languages
        # write it so) or absent; a property that is not a dict constrains nothing.
        expected = spec.get("type") if isinstance(spec, Mapping) else None
        allowed = [expected] if isinstance(expected, str) else list(expected or ())
        if not allowed or any(_fits(value, t) for t in allowed):
            continue
        return f"argument {key} of {tool.name} must be a {' or '.join(map(str, allowed))}"
    return None


def _fits(value: Any, expected: Any) -> bool:
    if expected == "null":
        return value is None
    types = _JSON_TYPES.get(expected) if isinstance(expected, str) else None
    if types is None:  # a type this check does not know: not the model's mistake
        return True
    # bool is an int subclass in Python, not a number in JSON
    return isinstance(value, types) and not (isinstance(value, bool) and expected != "boolean")


# What went wrong with an erroneous call: not a well-formed call (JSON, shape), a tool that
# does not exist, arguments that do not fit the schema, the tool refused them (it raised),
# it missed `call_timeout_s`, one call too many in a reply, or a call in a reply that
# answers (never run).
ERROR_KINDS = ("format", "unknown_tool", "arguments", "tool", "timeout", "over_limit",
               "with_answer")


@dataclasses.dataclass(frozen=True)
class ToolResult:
    content: str  # the tool message
    error: bool  # a garbled call (counted and penalised)
    timeout: bool = False
    kind: str = ""  # for an error, one of ERROR_KINDS


def run_tool_call(call: ToolCall, tools: Mapping[str, Tool], timeout_s: float) -> ToolResult:
    """Executes one parsed call → the tool message. Raises only a `ToolUnavailableError`:
    the tool's own (it cannot run), or `ToolResultTypeError` for a result that is not a
    `str`; neither is the call's fault, so neither is a tool error.

    With `timeout_s > 0` the function runs on a daemon thread and is abandoned past the
    deadline (a Python thread cannot be killed; the tools here return in microseconds, so
    a timeout means a runaway call, and the episode goes on without its result)."""
    if call.error is not None:
        return ToolResult(f"Error: {call.error}.", error=True, kind="format")
    tool = tools.get(call.name)
    if tool is None:
        return ToolResult(f"Error: unknown tool {call.name!r}; available: "
                          f"{', '.join(sorted(tools))}.", error=True, kind="unknown_tool")
    problem = check_arguments(tool, call.arguments)
    if problem is not None:
        return ToolResult(f"Error: {problem}.", error=True, kind="arguments")
    outcome: dict[str, Any] = {}

    def target():
        try:
            value = tool.fn(**call.arguments)
            if not isinstance(value, str):  # inside the try: handed on as unavailable
                raise ToolResultTypeError(
                    f"tool {tool.name!r} returned {type(value).__name__}, not str: a tool "
                    "function returns its message as text")
            outcome["value"] = value
        except TimeoutError as exc:  # the tool's own deadline (an MCP server's, say)
            outcome["error"], outcome["timeout"] = str(exc) or "timed out", True
        except ToolUnavailableError as exc:  # handed to the caller: not the model's mistake
            outcome["unavailable"] = exc
        except Exception as exc:  # the tool refused the arguments: the model's mistake
            outcome["error"] = str(exc) or type(exc).__name__

    if timeout_s > 0:
        thread = threading.Thread(target=target, daemon=True, name=f"tool-{tool.name}")
        thread.start()
        thread.join(timeout_s)
        if thread.is_alive():
            return ToolResult(f"Error: {tool.name} timed out after {timeout_s:g} s.",
                              error=True, timeout=True, kind="timeout")
    else:
        target()
    if "unavailable" in outcome:
        raise outcome["unavailable"]
    if "error" in outcome:
        timeout = outcome.get("timeout", False)
        return ToolResult(_clip(f"Error: {outcome['error']}"), error=True, timeout=timeout,
                          kind="timeout" if timeout else "tool")
    return ToolResult(_clip(outcome["value"]), error=False)


def _clip(text: str) -> str:
    return text if len(text) <= MAX_RESULT_CHARS else text[:MAX_RESULT_CHARS] + " …(cut)"


def tool_response_text(contents: Sequence[str]) -> str:
    """The tool messages as a text policy reads them (the Qwen template's wrapping)."""
    return "\n".join(f"{RESPONSE_OPEN}\n{c}\n{RESPONSE_CLOSE}" for c in contents)


def tool_responses(text: str) -> list[str]:
    """The contents of the `<tool_response>` blocks in `text` (inverse of the above)."""
    pattern = re.escape(RESPONSE_OPEN) + r"\n?(.*?)\n?" + re.escape(RESPONSE_CLOSE)
    return re.findall(pattern, text, flags=re.DOTALL)


# ---- the environment ------------------------------------------------------------------------


class ToolEnv(PythonTextEnv):
    """One episode of a tool-using task; subclasses set the task, this class plays it.

    A subclass implements `new_task(seed) -> (question_text, answer)` (and builds its tools
    in `__init__`), and may override `is_correct(given, answer)`. Each step:

    - a reply with an answer ends the episode: reward `correct_reward` if right, else 0
      (`success` = right). Tool calls in that same reply are not executed: each is an error;
    - else a reply with tool calls: the first `max_calls_per_turn` run (each under
      `call_timeout_s`), the rest are errors; the results are the step's `tool_messages`;
    - else (neither): the format penalty, and a user message saying what a reply needs.

    Every erroneous call costs `tool_error_penalty`, at most `max_tool_error_penalty` in all
    per episode (module doc); a tool's `ToolUnavailableError` raises out of `step`.
    `call_style` is the call form the hints show (`CALL_STYLES`); `extra_tools` are tools
    offered besides the task's own: names of registered tools (`register_tool`) or `Tool`s
    (an MCP server's, `envs/mcp_tools.py::server_tools`). `PyStep.action` is 0 for an
    answer, 1 for a turn of tool calls, -1 for neither; `action_is_valid` means "an answer, or
    calls none of which was garbled"; `action_is_effective`: a call returned a result.
    """

    instructions = ("Solve the task. Call the tools as often as you need; the results come "
                    "back to you. When you know the answer, reply <answer>ANSWER</answer>.")

    def __init__(self, tools: Sequence[Tool], *, format_penalty: float = 0.1,
                 tool_error_penalty: float = 0.1, correct_reward: float = 1.0,
                 max_calls_per_turn: int = 3, call_timeout_s: float = 1.0,
                 max_steps_in_episode: int = 6, max_tool_error_penalty: float = 0.5,
                 call_style: str = "qwen", extra_tools: Sequence[str | Tool] = ()):
        if max_calls_per_turn < 1:
            raise ValueError(f"max_calls_per_turn must be >= 1, got {max_calls_per_turn}")
        if min(call_timeout_s, format_penalty, tool_error_penalty, max_tool_error_penalty) < 0:
            raise ValueError("call_timeout_s, format_penalty, tool_error_penalty and "
                             "max_tool_error_penalty must be >= 0")
        if call_style not in CALL_STYLES:
            raise ValueError(f"call_style must be one of {CALL_STYLES}, got {call_style!r}")
        self.max_tool_error_penalty, self.call_style = float(max_tool_error_penalty), call_style
        self._error_penalty_charged = 0.0
        self.tool_list = list(tools) + [t if isinstance(t, Tool) else get_tool(t)
                                        for t in extra_tools]
        self.tools = {t.name: t for t in self.tool_list}
        if len(self.tools) < len(self.tool_list):
            raise ValueError(f"two tools share a name: {[t.name for t in self.tool_list]}")
        self.format_penalty, self.tool_error_penalty = float(format_penalty), float(
            tool_error_penalty)
        self.correct_reward = float(correct_reward)
        self.max_calls_per_turn, self.call_timeout_s = int(max_calls_per_turn), float(
            call_timeout_s)
        self.max_steps_in_episode = int(max_steps_in_episode)
        self.question: str | None = None
        self.answer: Any = None
        self._transcript: list[str] = []

    @property
    def tool_schemas(self) -> list[dict[str, Any]]:
        """What the chat template lists in the system prompt (`tools=`)."""
        return [t.schema for t in self.tool_list]

    def new_task(self, seed: int) -> tuple[str, Any]:
        raise NotImplementedError(f"{type(self).__name__} must implement new_task()")

    def is_correct(self, given: str, answer: Any) -> bool:
        return " ".join(given.split()).casefold() == " ".join(str(answer).split()).casefold()

    def reset(self, seed: int) -> str:
        self.question, self.answer = self.new_task(seed)
        self._transcript = [self.question]
        self._error_penalty_charged = 0.0
        return f"{self.instructions}\n{self.question}"

    def state_hash(self) -> bytes:
        if self.question is None:
            raise RuntimeError("state_hash() before reset()")
        # The situation is the question plus every result seen so far.
        return text_state_hash("\x00".join(self._transcript))

    def step(self, reply: str) -> PyStep:
        if self.question is None:
            raise RuntimeError("step() before reset()")
        calls = parse_tool_calls(reply)
        given = parse_answer(reply)
        if given is not None:
            correct = self.is_correct(given, self.answer)
            penalty = self._error_penalty(len(calls))  # calls the answer cut off
            return PyStep(observation="", reward=(self.correct_reward if correct else 0.0)
                          - penalty, terminated=True, action_is_valid=not calls,
                          action_is_effective=True, success=correct, action=0,
                          tool_calls=len(calls), tool_errors=len(calls),
                          tool_error_kinds=("with_answer",) * len(calls))
        if not calls:
            example = format_tool_call("NAME", {"ARGUMENT": "VALUE"}, self.call_style)
            return PyStep(observation=("Your reply had no tool call and no answer. Call a tool "
                                       f"with {example} or reply <answer>ANSWER</answer>."),
                          reward=-self.format_penalty, terminated=False, action_is_valid=False,
                          action_is_effective=False, success=False, action=INVALID_ACTION)
        results = [run_tool_call(c, self.tools, self.call_timeout_s)
                   for c in calls[:self.max_calls_per_turn]]
        results += [ToolResult(f"Error: at most {self.max_calls_per_turn} tool calls per "
                               "reply; this one was not run.", error=True, kind="over_limit")
                    for _ in calls[self.max_calls_per_turn:]]
        errors = sum(r.error for r in results)
        self._transcript.extend(r.content for r in results)
        return PyStep(observation="", reward=0.0 - self._error_penalty(errors),
                      terminated=False, action_is_valid=errors == 0,
                      action_is_effective=errors < len(results), success=False, action=1,
                      tool_messages=tuple(r.content for r in results), tool_calls=len(calls),
                      tool_errors=errors, tool_timeouts=sum(r.timeout for r in results),
                      tool_error_kinds=tuple(r.kind for r in results if r.error))


    def _error_penalty(self, errors: int) -> float:
        """`tool_error_penalty` per erroneous call, until the episode has paid
        `max_tool_error_penalty`."""
        penalty = min(self.tool_error_penalty * errors,
                      self.max_tool_error_penalty - self._error_penalty_charged)
        self._error_penalty_charged += penalty
        return penalty


def tool_env_factory(env_cls: type[ToolEnv], **options: Any):
    """The episode factory `(spec, run_seed) -> env_cls(run_seed=run_seed, **options)` of a
    task drawn from the episode seed alone (`reset`); one environment is built here, so that
    bad options fail at config time, not in a worker thread."""
    env_cls(**options)

    def factory(spec, run_seed: int) -> ToolEnv:
        del spec  # the seed comes with reset(); members of a group share the task
        return env_cls(run_seed=run_seed, **options)

    return factory


TOOL_METRICS = ("tool/calls", "tool/errors", "tool/timeouts")
ERROR_KIND_METRICS = tuple(f"tool/errors_{kind}" for kind in ERROR_KINDS)


def tool_episode_metrics(steps: Sequence[PyStep]) -> dict[str, float]:
    """Per-episode sums: `tool/calls`, `tool/errors` (garbled calls, timeouts included),
    `tool/timeouts`, `tool/errors_<kind>` per `ERROR_KINDS`; and `tool/turns_to_answer`
    (the turn that answered) when the episode ended with an answer."""
    kinds = [k for s in steps for k in s.tool_error_kinds]
    out = {"tool/calls": float(sum(s.tool_calls for s in steps)),
           "tool/errors": float(sum(s.tool_errors for s in steps)),
           "tool/timeouts": float(sum(s.tool_timeouts for s in steps)),
           **{f"tool/errors_{kind}": float(kinds.count(kind)) for kind in ERROR_KINDS}}
    if steps and steps[-1].terminated and steps[-1].action == 0:
        out["tool/turns_to_answer"] = float(len(steps))
    return out


def tool_metrics(episode_metrics: Sequence[Mapping[str, float]],
                 prefix: str = "") -> dict[str, float]:
    """Batch metrics from episodes' `tool_episode_metrics` (episodes without them, e.g. of
    a non-tool env, are skipped; {} when none has them):

    - `tool/calls`, `tool/errors`, `tool/timeouts`: totals over the batch;
    - `tool/errors_<kind>`: totals per kind of error (`ERROR_KINDS`);
    - `tool/calls_per_episode`: mean calls per episode;
    - `tool/valid_fraction`: 1 − errors / calls, the share of well-formed calls (1 if none);
    - `tool/answered`: the share of episodes that ended with an answer, and
      `tool/turns_to_answer` the mean turn of that answer (absent when none answered).
    """
    rows = [m for m in episode_metrics if "tool/calls" in m]
    if not rows:
        return {}
    out = {f"{prefix}{k}": float(sum(m.get(k, 0.0) for m in rows))
           for k in TOOL_METRICS + ERROR_KIND_METRICS}
    calls, errors = out[f"{prefix}tool/calls"], out[f"{prefix}tool/errors"]
    out[f"{prefix}tool/calls_per_episode"] = calls / len(rows)
    out[f"{prefix}tool/valid_fraction"] = 1.0 - errors / calls if calls else 1.0
    answered = [m["tool/turns_to_answer"] for m in rows if "tool/turns_to_answer" in m]
    out[f"{prefix}tool/answered"] = len(answered) / len(rows)
    if answered:
        out[f"{prefix}tool/turns_to_answer"] = sum(answered) / len(answered)
    return out
