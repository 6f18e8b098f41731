"""History policies: what an episode's next prompt holds once its whole history cannot fit.

An episode's history is a list of chat messages (the `role`/`content` dicts of a chat
template):

    [system]  user_0  |  assistant_1 answer_1  |  assistant_2 answer_2  |  ...
     head ------------ |  turn 1 ------------- |  turn 2 ------------- |

The *head* is the system message (when the run has a system prompt) and the first user
message (the task). A *turn* is one assistant reply and the environment's answer that
follows it: one user message (an observation) or the tool messages of the calls the reply
made (one per call). The last turn's answer is the prompt the next reply answers.

A policy maps the history to the messages the next prompt is rendered from:

* ``"full"`` (the default): the history itself. An episode whose next prompt would exceed
  ``max_input_length`` ends (``truncated_by_length``), as it always has.
* ``"window:<k>"``: the head and the last k turns (k ≥ 1).
* ``"drop_tool_outputs:<k>"``: every message kept, but each tool message before the last k
  tool messages gets the content ``TOOL_OUTPUT_STUB`` (k ≥ 0). It shortens only histories
  that hold tool results.
* the name of a function registered with ``register_history_fn(name, fn)``:
  ``fn(messages) -> messages``, given a copy of the history; what it returns must be a
  list of such dicts that starts with the head's roles (an optional system message, then a
  user message) and ends with a user or tool message (a prompt to answer).

When a policy applies (``rollout/segments.py``): only when the whole next prompt would not
fit ``max_input_length``. Until then the episode's stream grows append-only and the
sampler reuses its KV cache turn after turn; a rewrite breaks that (the rewritten history
is a new stream, prefilled from its first token, and a new training sample), so it is done
only when the context forces it and as rarely as the policy allows: a window that slid
every turn would make every turn a sample of its own with a fresh prefill.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable

from jaxrl_agentic.registration import same_registration

TOOL_OUTPUT_STUB = "[tool output omitted]"
BUILT_IN = ("full", "window", "drop_tool_outputs")
ROLES = ("system", "user", "assistant", "tool")

_HISTORY_FNS: dict[str, Callable] = {}


def register_history_fn(name: str, fn: Callable, *, replace: bool = False) -> None:
    """Makes ``custom_envs.<tag>.history=name`` rewrite histories with ``fn(messages) ->
    messages`` (module doc). The same registration again changes nothing
    (``registration.same_registration``); another one of a registered name is an error
    unless ``replace``."""
    if not isinstance(name, str) or not name or ":" in name or name in BUILT_IN:
        raise ValueError(f"history function name must be a non-empty string without ':' "
                         f"and not one of {BUILT_IN}, got {name!r}")
    if not callable(fn):
        raise TypeError(f"history function {name!r} must be callable, got "
                        f"{type(fn).__name__}")
    old = _HISTORY_FNS.get(name)
    if old is not None and not replace and not same_registration(old, fn):
        raise ValueError(f"history function {name!r} is already registered (replace=True "
                         "to change it)")
    _HISTORY_FNS[name] = fn


def history_fn_names() -> list[str]:
    return sorted(_HISTORY_FNS)


@dataclasses.dataclass(frozen=True)
class HistoryPolicy:
    """A parsed ``history`` setting: ``name`` (a built-in or a registered function), and
    the k of ``window:<k>`` / ``drop_tool_outputs:<k>``."""

    name: str = "full"
    k: int = 0

    @property
    def rewrites(self) -> bool:
        """Whether this policy can continue an episode past a full context."""
        return self.name != "full"

    def __call__(self, messages: list[dict]) -> list[dict]:
        """The messages the next prompt is rendered from (module doc)."""
        messages = [dict(m) for m in messages]
        if self.name == "full":
            return messages
        if self.name == "window":
            return window(messages, self.k)
        if self.name == "drop_tool_outputs":
            return drop_tool_outputs(messages, self.k)
        return checked_history(self.name, _HISTORY_FNS[self.name](messages))


FULL = HistoryPolicy()  # the default: the whole history, or the episode ends


def parse_history(value) -> HistoryPolicy:
    """The policy a ``history`` setting names, or ``ValueError("history: <why>")``."""
    if not isinstance(value, str):
        raise ValueError(f"history: must be a string, got {value!r}")
    name, colon, arg = value.partition(":")
    if name in ("window", "drop_tool_outputs"):
        least = 1 if name == "window" else 0
        if not colon or not arg.strip().isdigit() or int(arg) < least:
            raise ValueError(f"history: {name} needs an integer k >= {least} "
                             f"({name}:<k>), got {value!r}")
        return HistoryPolicy(name, int(arg))
    if not colon and (name == "full" or name in _HISTORY_FNS):
        return HistoryPolicy(name)
    registered = "".join(f", {n}" for n in history_fn_names())
    raise ValueError(f"history: unknown policy {value!r}; allowed: full, window:<k>, "
                     f"drop_tool_outputs:<k>{registered} (register_history_fn adds one)")


def split_turns(messages: list[dict]) -> tuple[list[dict], list[list[dict]]]:
    """(head, turns) of a history: the head ends at the first user message, and each turn
    starts at an assistant message (module doc)."""
    first_user = next((i for i, m in enumerate(messages) if m["role"] == "user"), None)
    if first_user is None:
        raise ValueError("a history needs a first user message")
    head, turns = messages[:first_user + 1], []
    for m in messages[first_user + 1:]:
        if m["role"] == "assistant" or not turns:
            turns.append([m])
        else:
            turns[-1].append(m)
    return head, turns


def window(messages: list[dict], k: int) -> list[dict]:
    """The head and the last `k` turns."""
    head, turns = split_turns(messages)
    return head + [m for turn in turns[max(0, len(turns) - k):] for m in turn]


def drop_tool_outputs(messages: list[dict], k: int) -> list[dict]:
    """Every message, each tool message before the last `k` with ``TOOL_OUTPUT_STUB`` as
    its content."""
    tools = [i for i, m in enumerate(messages) if m["role"] == "tool"]
    stubbed = set(tools[:max(0, len(tools) - k)])
    return [{**m, "content": TOOL_OUTPUT_STUB} if i in stubbed else m
            for i, m in enumerate(messages)]


def checked_history(name: str, messages) -> list[dict]:
    """`messages`, a history function's output, or one ValueError naming the function and
    what is wrong with it."""
    def bad(why: str):
        return ValueError(f"history function {name!r} returned {why}")

    if not isinstance(messages, list) or not messages:
        raise bad(f"{type(messages).__name__}, not a non-empty list of messages")
    for m in messages:
        if not (isinstance(m, dict) and m.get("role") in ROLES
                and isinstance(m.get("content"), str)):
            raise bad(f"{m!r:.80}: each message must be a dict with a role in {ROLES} "
                      "and str content")
    roles = [m["role"] for m in messages]
    start = 1 if roles[0] == "system" else 0
    if "system" in roles[start:] or len(roles) <= start or roles[start] != "user":
        raise bad(f"roles {roles}: a history starts with [system,] user and has no other "
                  "system message")
    if roles[-1] not in ("user", "tool"):
        raise bad(f"roles {roles}: a history ends with a user or tool message (the prompt "
                  "the next reply answers)")
    return messages
