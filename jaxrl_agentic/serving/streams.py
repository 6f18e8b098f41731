"""One outside agent's episode as token streams: continuations appended, rewrites split off.

An agent sends its whole chat with every request. The episode keeps the token stream of
what it has seen so far (`conversation.ChatFormatter`'s append-only stream) and the
messages that stream holds, ending with the reply it was sent (`canonical_message` form).
A request is a *continuation* when

    request.messages == held messages (our last reply included) + new messages

with the same tools; then only the new messages are tokenised and appended (one user
message: `next_prompt`; tool results: `tool_prompt`), and the reply the agent echoes back
is never re-tokenised: the stream holds the tokens the sampler drew. Anything else — the
agent dropped a tool result, summarised, edited our reply, retried a request — is a
rewritten history: it starts a new sample of the same episode (a fresh stream, counted in
`rewritten_histories`), and every sample of the episode gets the episode's reward. New
messages the formatter cannot append in one piece (a system message, tool results and a
user message together) start a new sample too (`unappendable_messages`).

A new sample's first prompt is `first_prompt` for [system] + user (tools listed the
chat template's way, or in the system turn for a template without a tools block); a longer
history (an agent that starts from a rewritten one) is rendered whole by the template. All
of it is context (loss mask 0).
"""

from __future__ import annotations

import hashlib
import json

import numpy as np

from jaxrl_agentic.data.trajectory import Trajectory, Turn
from jaxrl_agentic.rollout.conversation import ChatFormatter, tools_system_text
from jaxrl_agentic.serving.protocol import ChatRequest, RequestError, canonical_message

# Ids of an episode's later samples: base + first sample's id × MAX_SAMPLES + k, above the
# pipeline's trajectory ids and within the sampler's int32 seed ids.
EXTRA_SAMPLE_ID_BASE = 1 << 30
MAX_SAMPLES_PER_EPISODE = 64


def context_hash(ids) -> bytes:
    """The GiGPO anchor of a turn: its exact context (equal contexts, equal states)."""
    return hashlib.blake2b(np.asarray(ids, np.int32).tobytes(), digest_size=16).digest()


class Formatters:
    """One `ChatFormatter` per system prompt (its skeleton renders that system turn), all
    without a reply prefix or suffix: an outside agent reads the reply as the model wrote it."""

    def __init__(self, tokenizer):
        self.tokenizer = tokenizer
        self._by_system: dict[str | None, ChatFormatter] = {}

    def __call__(self, system: str | None) -> ChatFormatter:
        if system not in self._by_system:
            self._by_system[system] = ChatFormatter(self.tokenizer, system_prompt=system)
        return self._by_system[system]


class AgentSample:
    """One token stream of an episode (a `Trajectory`) and the messages it holds."""

    def __init__(self, trajectory: Trajectory, formatter: ChatFormatter,
                 tools: tuple[dict, ...] | None):
        self.trajectory, self.formatter, self.tools = trajectory, formatter, tools
        self.messages: list[dict] = []  # canonical, our last reply included
        self.tools_key = json.dumps(tools, sort_keys=True)


class AgentEpisode:
    """The samples of one outside agent's episode (module doc)."""

    def __init__(self, spec, traj_id: int, tag: str, formatters: Formatters, *,
                 max_input_length: int, max_turns: int):
        self.spec, self.traj_id, self.tag = spec, traj_id, tag
        self.formatters = formatters
        self.max_input_length, self.max_turns = max_input_length, max_turns
        self.samples: list[AgentSample] = []
        self.answered: list[Turn] = []  # every sample's turns, in the order answered
        self.counts = {"requests": 0, "rewritten_histories": 0, "unappendable_messages": 0,
                       "sampling_overridden": 0}

    @property
    def turns(self) -> int:
        return sum(len(s.trajectory.turns) for s in self.samples)

    def prompt(self, request: ChatRequest) -> tuple[AgentSample, list[int]]:
        """The sample `request` extends (or a new one) and the ids appended to its stream
        (not yet appended: `accept`). RequestError when the turn budget is spent or the
        prompt would not fit `max_input_length`."""
        self.counts["requests"] += 1
        if self.turns >= self.max_turns:
            if self.samples:
                self.samples[-1].trajectory.truncated = True
            raise RequestError(400, f"this episode has had its max_turns={self.max_turns} "
                               "replies", code="max_turns_exceeded")
        sample, ids = self._continuation(request)
        if sample is None:
            sample, ids = self._new_sample(request)
        if len(sample.trajectory.tokens) + len(ids) > self.max_input_length:
            sample.trajectory.truncated = sample.trajectory.truncated_by_length = True
            raise RequestError(400, f"the prompt would be "
                               f"{len(sample.trajectory.tokens) + len(ids)} tokens, over "
                               f"max_input_length={self.max_input_length}",
                               param="messages", code="context_length_exceeded")
        return sample, ids

    def _continuation(self, request: ChatRequest):
        if not self.samples:
            return None, None
        last = self.samples[-1]
        held = len(last.messages)
        if (json.dumps(request.tools, sort_keys=True) != last.tools_key
                or len(request.messages) <= held
                or list(request.messages[:held]) != last.messages):
            self.counts["rewritten_histories"] += 1
            return None, None
        ids = appended_ids(last.formatter, request.messages[held:])
        if ids is None:
            self.counts["unappendable_messages"] += 1
            return None, None
        return last, ids

    def _new_sample(self, request: ChatRequest) -> tuple[AgentSample, list[int]]:
        k = len(self.samples)
        if k >= MAX_SAMPLES_PER_EPISODE:
            raise RequestError(400, f"this episode has started {k} samples (rewritten "
                               "histories), the most it may", code="too_many_samples")
        traj_id = self.traj_id if k == 0 else (
            EXTRA_SAMPLE_ID_BASE + self.traj_id * MAX_SAMPLES_PER_EPISODE + k)
        messages = list(request.messages)
        system = messages[0]["content"] if messages[0]["role"] == "system" else None
        formatter = self.formatters(system)
        trajectory = Trajectory(traj_id=traj_id, group_id=self.spec.group_id, tag=self.tag,
                                seed=self.spec.seed, tokens=[], turns=[],
                                member=self.spec.member)
        sample = AgentSample(trajectory, formatter, request.tools)
        rest = messages[1:] if system is not None else messages
        tools = list(request.tools) if request.tools else None
        if len(rest) == 1 and rest[0]["role"] == "user":
            ids = formatter.first_prompt(rest[0]["content"], tools=tools)
        else:
            ids = whole_history_ids(formatter, messages, tools)
        self.samples.append(sample)
        return sample, ids

    def accept(self, sample: AgentSample, request: ChatRequest, ids: list[int]) -> int:
        """Appends the prompt ids to the sample's stream; → the turn's context length."""
        sample.trajectory.tokens.extend(ids)
        sample.messages = list(request.messages)
        return len(sample.trajectory.tokens)

    def record_reply(self, sample: AgentSample, *, context_len: int, ids: list[int],
                     logprobs, stop_reason: str, message: dict, text: str,
                     versions=None) -> bool:
        """Appends a reply to the sample's stream — closed with an EOS the model did not
        generate when it stopped otherwise — and the message sent for it to the messages
        it holds. → whether the EOS was appended."""
        traj = sample.trajectory
        eos = sample.formatter.eos_token_id
        traj.tokens.extend(ids)
        eos_appended = not ids or ids[-1] != eos or stop_reason != "eos"
        if eos_appended:
            traj.tokens.append(eos)
        valid = "tool_calls" in message or CALL_MARK not in text
        self.answered.append(Turn(
            context_len=context_len, generated=list(ids),
            logprobs=np.asarray(logprobs, np.float32), stop_reason=stop_reason,
            eos_appended=eos_appended, reward=0.0, action=-1, action_is_valid=valid,
            action_is_effective=valid, success=False, done=False,
            state_hash=context_hash(traj.tokens[:context_len]), reply=text,
            versions=None if versions is None else np.asarray(versions, np.int32)))
        traj.turns.append(self.answered[-1])
        sample.messages.append(canonical_message(message, len(sample.messages)))
        return eos_appended

    def finish(self, outcome, *, failed: bool) -> list[Trajectory]:
        """Every sample's trajectory, as segments 0, 1, … of the episode
        (`Trajectory.segment`): the agent's `outcome` (`envs.outside_agent.AgentOutcome`)
        sets the rewards: its `turn_rewards`, when given, on the turns in the order they
        were answered, and its reward added on the last turn of the last segment that has
        turns, once, so the episode counts once in its group's statistics
        (`algos.estimators.turn_advantages` joins the segments); a failed episode ends
        truncated, the others terminated, each segment as the episode."""
        trajs = [s.trajectory for s in self.samples]
        if outcome.turn_rewards is not None:
            for turn, reward in zip(self.answered, outcome.turn_rewards, strict=True):
                turn.reward = float(reward)
        last = max((k for k, t in enumerate(trajs) if t.turns), default=None)
        for k, traj in enumerate(trajs):
            traj.segment = k
            if k == last:
                traj.turns[-1].reward += float(outcome.reward)
                traj.turns[-1].success = (outcome.reward > 0 if outcome.success is None
                                          else outcome.success)
                traj.turns[-1].done = not failed
            traj.terminated = not failed and not traj.truncated
            traj.truncated = traj.truncated or failed
        return trajs


CALL_MARK = "<tool_call>"


def appended_ids(formatter: ChatFormatter, new_messages) -> list[int] | None:
    """Ids of `new_messages` appended after an assistant turn: one user message, or one or
    more tool results; None for anything else (module doc)."""
    roles = [m["role"] for m in new_messages]
    if roles == ["user"]:
        return formatter.next_prompt(new_messages[0]["content"])
    if roles and all(r == "tool" for r in roles):
        return formatter.tool_prompt([m["content"] for m in new_messages])
    return None


def whole_history_ids(formatter: ChatFormatter, messages: list[dict],
                      tools: list | None) -> list[int]:
    """Ids of a whole history + the generation prompt, rendered by the template at once;
    assistant messages with tool calls get them as `<tool_call>` blocks in their text, and
    a template without a tools block gets the tools in the system turn (`first_prompt`)."""
    rendered = []
    for m in messages:
        content = m["content"]
        for call in m.get("tool_calls", ()):
            body = json.dumps({"name": call["name"], "arguments": json.loads(call["arguments"])},
                              ensure_ascii=False)
            content += f"{CALL_MARK}\n{body}\n</tool_call>"
        rendered.append({"role": m["role"], "content": content})
    if tools and not formatter.template_lists_tools:
        has_system = rendered[0]["role"] == "system"
        base = rendered[0]["content"] if has_system else formatter.default_system_prompt
        system = {"role": "system",
                  "content": (base + "\n\n" if base else "") + tools_system_text(tools)}
        rendered = [system] + (rendered[1:] if has_system else rendered)
        tools = None
    kwargs = {"tools": tools} if tools else {}
    text = formatter.tokenizer.apply_chat_template(rendered, tokenize=False,
                                                   add_generation_prompt=True, **kwargs)
    return formatter.encode(text)
