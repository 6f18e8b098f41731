"""Token-level conversations: new messages are tokenized and appended, history never is.

Re-tokenizing a growing chat each turn silently changes earlier tokens (BPE merges across
turn boundaries) and breaks the prefix property that KV-cache reuse and prefix merge rely
on. Here a trajectory is one append-only list of ids:

    [first user message + generation prompt] [generated] [EOS if the code appended it]
    [template tail of the assistant turn + next user message + generation prompt] ...

The per-message pieces come from the tokenizer's own chat template. A template renders a
whole conversation, so the piece for a new user message is the *text difference* between
rendering a fixed two-message skeleton with and without that message:

    delta(user) = tail_after_eos(T([u, a])) + T([u, a, user], gen=True)[len(T([u, a])):]

which is exact for templates whose rendering of a message does not depend on the content
of the messages after it (true of Qwen2/Qwen2.5/Llama 3 templates).

Qwen3's template does depend on it: once a later user message exists it re-renders past
assistant turns (drops their `<think>` block and the empty one it gives the last turn), so
T([u, a, user]) does not start with T([u, a]). The stream never holds the template's
rendering of a reply, only what the model generated, so the delta is then what the template
puts after the assistant turn's EOS in T([u, a, user], gen=True), provided everything
before that assistant turn renders as before. A template that re-renders anything else
fails when the formatter is built, with one line.

Tools (`envs/tools.py`): `first_prompt(text, tools=schemas)` renders the template with its
`tools` argument (a Qwen-style template lists them in the system prompt), and
`tool_prompt(results)` is the piece for `tool` messages, found the same way:

    delta(tools) = tail_after_eos(T([u, a]))
                   + T([u, a, tool_1, …, tool_k], gen=True)[len(T([u, a])):]

so consecutive tool messages are rendered together, as the template groups them (Qwen2.5
wraps them in one user turn of `<tool_response>` blocks). A template without a tools block
(its rendering ignores `tools`: SmolLM2's, a plain ChatML one) gets them described in the
system turn instead, in Qwen2.5's words (`tools_system_text`): the recipe's system prompt,
else the template's default one, then the schemas and the `<tool_call>` JSON call format;
its `tool` messages are what the template makes of that role.

Environment and tool text is data, not markup: a message whose content holds the text of a
special token (``<|im_end|>``, ``<|im_start|>``: a tool error echoing the model's reply, an
observation quoting a chat log) would otherwise be tokenised into real control tokens and
forge a turn boundary in the next prompt. Such content is encoded with its special-token
strings as plain text (``split_special_tokens``); the template around it keeps its control
tokens. Content without them is encoded exactly as before, in one piece with the template.
Searching the rendering for the content would be wrong twice over: a content equal to a
piece of the template before it (``<|im_start|>``) matches the template's own control token,
and a template that renders ``content | trim`` (Llama 3) does not show the content verbatim.
So the content is located by rendering: with a placeholder H_i (private-use characters no
message holds) in its place, the rendering splits into template text around it,

    T(…, H_i, …) = A_i + H_i + B_i,   T(…, c_i, …) = A_i + r_i + B_i,

and r_i, what the template renders for c_i (trimmed, escaped), is encoded as plain text;
A and B keep their control tokens. The system prompt is such a content too.

`reply_prefix` (e.g. "<answer>") is appended to every generation prompt, so the model's
reply starts after it, and is put back in front of the reply text before parsing. The
prefix tokens are context (loss mask 0), not generated tokens: the "assistant prefill" of
chat APIs. Why it exists: in a contextual bandit through the learner after a format
warm-up (`scripts/analysis/probe_reply_format.py`), the decision token was learned when it
was the first generated token (p(right) 0.25 → 0.9 in 100 updates) and not at all when a
generated open tag preceded it (chance after 150). Trailing generated tokens slowed it too.
`reply_suffix` (e.g. "</answer>") is appended to the reply text for the parser only; it is
not put in the stream. With both and `max_tokens_per_step=1` the model generates exactly the
action token, and the code closes the turn with EOS (loss mask 0).
"""

from __future__ import annotations

import functools
import json

# How tools are listed for a model whose chat template has no tools block (its rendering
# ignores `tools`, as SmolLM2's does): Qwen2.5's own wording, put at the end of the system
# turn (after the recipe's system prompt, else the template's default one), so calls are
# the same `<tool_call>` JSON blocks a Qwen-style template asks for.
TOOLS_SYSTEM_HEADER = (
    "# Tools\n\nYou may call one or more functions to assist with the user query.\n\n"
    "You are provided with function signatures within <tools></tools> XML tags:\n<tools>")
TOOLS_SYSTEM_FOOTER = (
    "\n</tools>\n\nFor each function call, return a json object with function name and "
    "arguments within <tool_call></tool_call> XML tags:\n<tool_call>\n"
    '{"name": <function-name>, "arguments": <args-json-object>}\n</tool_call>')


def _between(text: str, before: str, after: str) -> str | None:
    """r where ``text == before + r + after``, or None when `text` is not of that form."""
    if len(text) < len(before) + len(after) or not text.startswith(before) \
            or not text.endswith(after):
        return None
    return text[len(before):len(text) - len(after)]


def tools_system_text(tools: list[dict]) -> str:
    """The tools block of a system turn: header, one JSON schema a line, footer."""
    schemas = "".join("\n" + json.dumps(t, ensure_ascii=False) for t in tools)
    return TOOLS_SYSTEM_HEADER + schemas + TOOLS_SYSTEM_FOOTER


class ChatFormatter:
    """Turns messages into the token ids to append to a conversation stream."""

    def __init__(self, tokenizer, system_prompt: str | None = None, reply_prefix: str = "",
                 reply_suffix: str = ""):
        if getattr(tokenizer, "chat_template", None) is None:
            raise ValueError("the tokenizer has no chat_template; multi-turn rollouts need one")
        if tokenizer.eos_token_id is None:
            raise ValueError("the tokenizer has no eos_token; multi-turn rollouts need one")
        self.tokenizer = tokenizer
        # The strings the tokenizer turns into special (control) tokens, longest first.
        self._control_strings = sorted(
            {t.content for t in getattr(tokenizer, "added_tokens_decoder", {}).values()
             if t.special} | set(getattr(tokenizer, "all_special_tokens", [])),
            key=len, reverse=True)
        self.system_prompt = system_prompt
        self.reply_prefix = reply_prefix
        self.reply_suffix = reply_suffix
        self._prefix_ids = self.encode(reply_prefix) if reply_prefix else []
        self.eos_token_id = int(tokenizer.eos_token_id)
        self._eos_text = tokenizer.eos_token
        skeleton = self._system() + [
            {"role": "user", "content": "u"},
            {"role": "assistant", "content": "a"},
        ]
        base = self._render(skeleton, generation_prompt=False)
        cut = base.rfind(self._eos_text)
        if cut < 0:
            raise ValueError("the chat template does not end assistant turns with the EOS token")
        self._skeleton = skeleton
        self._base = base
        self._assistant_tail = base[cut + len(self._eos_text) :]
        # Qwen3-style templates (module docstring): the rendering before the assistant turn
        # must not change, and the assistant turn must close with the same EOS count.
        self._before_assistant = self._render(skeleton[:-1], generation_prompt=False)
        self._eos_in_base = base.count(self._eos_text)
        probe_user = [{"role": "user", "content": "u"}]
        probe_tool = [{"type": "function", "function": {"name": "probe", "parameters": {}}}]
        self.template_lists_tools = (self._render(probe_user, True, tools=probe_tool)
                                     != self._render(probe_user, True))
        self.default_system_prompt = self._default_system_prompt()
        self._next_prompt_text("probe")  # an unsupported template fails here, not at turn 2
        # ... as does one that hides where a message's content is (a probe with control text).
        self._encode_rendered(lambda cs: self._next_prompt_text(cs[0]),
                              [f"probe {self._eos_text}"])

    def _default_system_prompt(self) -> str | None:
        """The system text the template writes when the conversation has none (SmolLM2's
        "You are a helpful AI assistant named SmolLM, ..."), or None."""
        mark = self._placeholders(["u"])[0]
        with_system = self._render([{"role": "system", "content": mark},
                                    {"role": "user", "content": "u"}], True)
        alone = self._render([{"role": "user", "content": "u"}], True)
        if with_system.count(mark) != 1:
            return None
        before, after = with_system.split(mark)
        return _between(alone, before, after) or None

    def _system(self) -> list[dict]:
        return [{"role": "system", "content": self.system_prompt}] if self.system_prompt else []

    def _render(self, messages, generation_prompt: bool, tools=None) -> str:
        kwargs = {"tools": tools} if tools else {}  # templates without tool support still work
        return self.tokenizer.apply_chat_template(
            messages, tokenize=False, add_generation_prompt=generation_prompt, **kwargs
        )

    def encode(self, text: str) -> list[int]:
        return list(self.tokenizer.encode(text, add_special_tokens=False))

    def encode_plain(self, text: str) -> list[int]:
        """Ids of `text` with every special-token string in it as plain text."""
        return list(self.tokenizer.encode(text, add_special_tokens=False,
                                          split_special_tokens=True))

    def _encode_rendered(self, render, contents: list[str]) -> list[int]:
        """Ids of `render(contents)`, a template rendering of `contents` (environment, tool or
        system text, in order), with the special-token strings of each content as plain text
        where the template put that content (module doc)."""
        text = render(contents)
        marked = [any(m in c for m in self._control_strings) for c in contents]
        if not any(marked):
            return self.encode(text)
        holes = self._placeholders(contents)
        # Marked contents become placeholders; the others stay, in the template's text.
        with_holes = [h if m else c for h, c, m in zip(holes, contents, marked, strict=True)]
        spaced = render(with_holes)
        ids, pos, rebuilt = [], 0, []
        for i in (i for i, m in enumerate(marked) if m):
            start = spaced.find(holes[i], pos)
            if start < 0 or spaced.count(holes[i]) != 1:
                raise ValueError("the chat template does not render each message's content "
                                 "once, as given; cannot keep its special-token text plain")
            end = start + len(holes[i])
            alone = render(with_holes[:i] + [contents[i]] + with_holes[i + 1:])
            shown = _between(alone, spaced[:start], spaced[end:])  # what it renders for it
            if shown is None:
                raise ValueError("the chat template renders the text around a message "
                                 "differently for different contents; cannot keep its "
                                 "special-token text plain")
            ids += self.encode(spaced[pos:start]) + self.encode_plain(shown)
            rebuilt += [spaced[pos:start], shown]
            pos = end
        rebuilt.append(spaced[pos:])
        if "".join(rebuilt) != text:
            raise ValueError("the chat template renders the text around messages differently "
                             "for different contents; cannot keep special-token text plain")
        return ids + self.encode(spaced[pos:])

    @staticmethod
    def _placeholders(contents: list[str]) -> list[str]:
        """One string per content that no content holds: a private-use character (never in
        a chat template's text) around the content's index."""
        for code in range(0xE000, 0xF900):
            mark = chr(code)
            if not any(mark in c for c in contents):
                return [f"{mark}{i}{mark}" for i in range(len(contents))]
        raise ValueError("every private-use character occurs in the messages")

    def first_prompt(self, user_content: str, tools: list[dict] | None = None) -> list[int]:
        """Ids of [system] + first user message + the assistant generation prompt; `tools`
        (JSON schemas) go to the template, which lists them in the system prompt. A template
        without a tools block gets them at the end of the system turn instead
        (`tools_system_text`), after the recipe's system prompt or the template's default."""
        system_prompt = self.system_prompt
        if tools and not self.template_lists_tools:
            base = self.system_prompt or self.default_system_prompt
            system_prompt = (base + "\n\n" if base else "") + tools_system_text(tools)
            tools = None

        def render(contents):
            system = ([{"role": "system", "content": contents[0]}] if len(contents) == 2
                      else [])
            return self._render(system + [{"role": "user", "content": contents[-1]}],
                                generation_prompt=True, tools=tools)

        contents = [system_prompt] if system_prompt else []
        return self._encode_rendered(render, contents + [user_content]) + self._prefix_ids

    def history_prompt(self, messages: list[dict], tools: list[dict] | None = None
                       ) -> list[int]:
        """Ids of a whole conversation (`messages`: [system,] user, then assistant, user and
        tool messages, ending with a user or tool message) + the generation prompt (+ reply
        prefix), rendered by the template at once: the first prompt of a rewritten history
        (`rollout/history.py`). The system message and `tools` are treated as `first_prompt`
        treats them (a template without a tools block gets the tools in the system turn),
        so ``history_prompt([user]) == first_prompt(user["content"])``."""
        system = messages[0]["content"] if messages[0]["role"] == "system" else None
        rest = messages[1:] if system is not None else messages
        if tools and not self.template_lists_tools:
            base = system or self.default_system_prompt
            system = (base + "\n\n" if base else "") + tools_system_text(tools)
            tools = None
        roles = (["system"] if system else []) + [m["role"] for m in rest]
        contents = ([system] if system else []) + [m["content"] for m in rest]

        def render(cs):
            return self._render([{"role": r, "content": c} for r, c in zip(roles, cs,
                                                                            strict=True)],
                                generation_prompt=True, tools=tools)

        return self._encode_rendered(render, contents) + self._prefix_ids

    def _next_prompt_text(self, user_content: str) -> str:
        return self._appended_text([{"role": "user", "content": user_content}])

    def _appended_text(self, messages: list[dict]) -> str:
        """Text to append after an assistant turn that ended with EOS for `messages` (user or
        tool) + the generation prompt; see the module docstring."""
        full = self._render(self._skeleton + messages, generation_prompt=True)
        if full.startswith(self._base):
            return self._assistant_tail + full[len(self._base) :]
        # The template re-rendered the past assistant turn (Qwen3): append what follows its
        # EOS, the same EOS the stream holds after the reply.
        end = -1
        for _ in range(self._eos_in_base):
            end = full.find(self._eos_text, end + 1)
            if end < 0:
                break
        if end < 0 or not full.startswith(self._before_assistant):
            raise ValueError("the chat template re-renders earlier user/system messages "
                             "when a message is added; token-level conversations cannot "
                             "append to it")
        delta = full[end + len(self._eos_text) :]
        if not delta.startswith(self._assistant_tail):
            raise ValueError("the chat template closes a past assistant turn differently "
                             "once a message follows it; cannot append")
        return delta

    def next_prompt(self, user_content: str) -> list[int]:
        """Ids to append after an assistant turn that ended with EOS: template tail + user
        message + generation prompt (+ reply prefix)."""
        return (self._encode_rendered(lambda cs: self._next_prompt_text(cs[0]), [user_content])
                + self._prefix_ids)

    def tool_prompt(self, results: list[str] | tuple[str, ...]) -> list[int]:
        """Ids to append after an assistant turn that ended with EOS and called tools: the
        results as `tool` messages (one per call, in order) + generation prompt (+ prefix)."""
        if not results:
            raise ValueError("tool_prompt needs at least one tool result")
        def render(contents):
            return self._appended_text([{"role": "tool", "content": c} for c in contents])

        return self._encode_rendered(render, list(results)) + self._prefix_ids

    @functools.cached_property
    def _tool_wrapping(self) -> tuple[str, str, str]:
        """(A, M, B) with ``T(tool H_1) = A + H_1 + B`` and ``T(tool H_1, tool H_2) = A + H_1
        + M + H_2 + B``: how the template wraps `tool` messages (module doc)."""
        h1, h2 = self._placeholders(["", ""])
        one = self._appended_text([{"role": "tool", "content": h1}])
        two = self._appended_text([{"role": "tool", "content": h} for h in (h1, h2)])
        if one.count(h1) != 1 or two.count(h1) != 1 or two.count(h2) != 1:
            raise ValueError("the chat template does not render each tool message's "
                             "content once; cannot read tool results back")
        before, after = one.split(h1)
        middle = two.split(h1)[1].split(h2)[0]
        if not (two.startswith(before + h1) and two.endswith(h2 + after)):
            raise ValueError("the chat template wraps one tool message differently from "
                             "several; cannot read tool results back")
        return before, middle, after

    def tool_results(self, text: str) -> list[str]:
        """The contents of the tool messages in `text`, a decoded `tool_prompt` piece, as the
        template rendered them, whatever it makes of the `tool` role (Qwen2.5's
        `<tool_response>` blocks in a user turn, SmolLM2's bare `tool` turns); [] when
        `text` holds no tool messages. The inverse of `tool_prompt` that the format
        warm-up's text policies read (`warmup.text_policy_replies`)."""
        before, middle, after = self._tool_wrapping
        start = text.find(before)
        end = text.rfind(after)
        if start < 0 or end < start + len(before):
            return []
        return text[start + len(before):end].split(middle)

    def decode_reply(self, ids) -> str:
        """The reply text as the environment parses it: prefix + generated text + suffix."""
        text = self.tokenizer.decode(list(ids), skip_special_tokens=True)
        return self.reply_prefix + text + self.reply_suffix

    def reply_ids(self, text: str) -> list[int]:
        """Ids the model must generate for a full reply `text` (prefix + body + suffix), then
        EOS: the scripted replies of the format warm-up."""
        if not (text.startswith(self.reply_prefix) and text.endswith(self.reply_suffix)):
            raise ValueError(f"reply {text!r} does not start with reply_prefix "
                             f"{self.reply_prefix!r} and end with reply_suffix "
                             f"{self.reply_suffix!r}")
        body = text[len(self.reply_prefix):len(text) - len(self.reply_suffix)]
        return self.encode(body) + [self.eos_token_id]
