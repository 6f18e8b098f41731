"""Token fidelity of an outside agent's episode: a continuation appends only the new
messages and keeps the sampled ids of every reply (never its text re-tokenised), so the
stream is the chat template's own rendering of the whole chat; a rewritten history starts a
new sample, counted, that shares the episode's reward."""

import dataclasses

import pytest
import transformers

from jaxrl_agentic.envs.outside_agent import AgentOutcome
from jaxrl_agentic.envs.tools import format_tool_call
from jaxrl_agentic.pipeline.metrics import trajectory_metrics
from jaxrl_agentic.rollout.groups import EpisodeSpec
from jaxrl_agentic.rollout.turns import set_episode_metrics
from jaxrl_agentic.serving.protocol import assistant_message, parse_chat_request
from jaxrl_agentic.serving.streams import EXTRA_SAMPLE_ID_BASE, AgentEpisode, Formatters

TOOLS = [{"type": "function", "function": {
    "name": "add", "description": "a + b",
    "parameters": {"type": "object", "properties": {"a": {"type": "number"},
                                                    "b": {"type": "number"}}}}}]
SYSTEM = {"role": "system", "content": "You add numbers."}


@pytest.fixture(scope="module", params=["tiny", "qwen"])
def tokenizer(request):
    name = "tiny_model_dir" if request.param == "tiny" else "qwen_fixture_dir"
    return transformers.AutoTokenizer.from_pretrained(request.getfixturevalue(name))


def episode(tokenizer, max_input_length=4000):
    return AgentEpisode(EpisodeSpec(seed=4, group_id=2, member=1), 7, "agent",
                        Formatters(tokenizer), max_input_length=max_input_length, max_turns=8)


def ask(ep, messages, tools=TOOLS):
    request = parse_chat_request({"messages": messages, "tools": tools})
    sample, ids = ep.prompt(request)
    return sample, request, ep.accept(sample, request, ids)


def reply(ep, tokenizer, sample, context_len, text, split_chars=False):
    """Records `text` as the model's reply, its ids as a sampler might draw them: with
    `split_chars`, one token per character (not the tokenizer's own spelling of it)."""
    ids = ([i for ch in text for i in tokenizer.encode(ch, add_special_tokens=False)]
           if split_chars else tokenizer.encode(text, add_special_tokens=False))
    ids.append(tokenizer.eos_token_id)
    message = assistant_message(text, "auto", f"call_{len(sample.trajectory.turns)}")
    ep.record_reply(sample, context_len=context_len, ids=ids, logprobs=[-1.0] * len(ids),
                    stop_reason="eos", message=message, text=text)
    return ids, message


def rendered(tokenizer, messages, tools=TOOLS, generation_prompt=False):
    """The whole chat as the template renders it (the stream ends at the last EOS)."""
    kwargs = {"tools": tools} if tools else {}
    text = tokenizer.apply_chat_template(messages, tokenize=False,
                                         add_generation_prompt=generation_prompt, **kwargs)
    if not generation_prompt:
        text = text[:text.rindex(tokenizer.eos_token) + len(tokenizer.eos_token)]
    return text


def test_continuations_append_and_keep_the_sampled_ids(tokenizer):
    ep = episode(tokenizer)
    call = "I will add. " + format_tool_call("add", {"a": 2, "b": 3})
    chat = [SYSTEM, {"role": "user", "content": "What is 2 + 3?"}]
    sample, _, ctx1 = ask(ep, chat)
    ids1, msg1 = reply(ep, tokenizer, sample, ctx1, call, split_chars=True)
    assert msg1["tool_calls"][0]["function"]["name"] == "add"
    # The agent echoes the message it got (as an SDK dumps it) and sends the tool result.
    chat += [dict(msg1, refusal=None), {"role": "tool", "tool_call_id": "call_0_0",
                                        "content": "5"}]
    again, _, ctx2 = ask(ep, chat)
    assert again is sample
    ids2, msg2 = reply(ep, tokenizer, sample, ctx2, "It is 5.")
    chat += [msg2, {"role": "user", "content": "Thanks! <|im_end|> and 1 + 1?"}]
    _, _, ctx3 = ask(ep, chat)
    ids3, _ = reply(ep, tokenizer, sample, ctx3, "2", split_chars=True)

    traj = sample.trajectory
    assert len(ep.samples) == 1 and ep.counts["rewritten_histories"] == 0
    assert [t.context_len for t in traj.turns] == [ctx1, ctx2, ctx3]
    for turn, ids in zip(traj.turns, (ids1, ids2, ids3), strict=True):
        assert traj.tokens[turn.context_len:turn.context_len + len(ids)] == ids == turn.generated
        assert not turn.eos_appended
    # Each context is the template's rendering of the chat up to it, generation prompt on.
    as_text = [m if m["role"] != "assistant" else {"role": "assistant", "content": t}
               for m, t in zip(chat, ["", "", call, "", "It is 5.", ""], strict=True)]
    decode = tokenizer.decode
    assert decode(traj.tokens[:ctx1]) == rendered(tokenizer, as_text[:2], generation_prompt=True)
    assert decode(traj.tokens[:ctx2]) == rendered(tokenizer, as_text[:4], generation_prompt=True)
    # The whole stream is the template's rendering of the whole chat (the reply split into
    # characters decodes to the same text), and the user text that spells a control token
    # stays plain text, not a turn boundary.
    whole = as_text + [{"role": "assistant", "content": "2"}]
    assert decode(traj.tokens) == rendered(tokenizer, whole)
    im_end = tokenizer.convert_tokens_to_ids("<|im_end|>")
    assert traj.tokens[ctx2:ctx3].count(im_end) == 2  # after "It is 5." and the user turn


def test_a_rewritten_history_starts_a_new_sample_that_shares_the_reward(tokenizer):
    ep = episode(tokenizer)
    chat = [SYSTEM, {"role": "user", "content": "What is 2 + 3?"}]
    first, _, ctx = ask(ep, chat)
    reply(ep, tokenizer, first, ctx, "It is 6.")
    # The agent summarises: our reply is replaced by its own words.
    rewritten = chat + [{"role": "assistant", "content": "(I said 6)"},
                        {"role": "user", "content": "Check again."}]
    second, _, ctx2 = ask(ep, rewritten)
    assert second is not first and ep.counts["rewritten_histories"] == 1
    assert tokenizer.decode(second.trajectory.tokens) == rendered(
        tokenizer, rewritten, generation_prompt=True)
    reply(ep, tokenizer, second, ctx2, "It is 5.")
    # New messages that cannot be appended in one piece (a tool result and a user turn).
    mixed = rewritten + [second.messages[-1], {"role": "tool", "content": "5"},
                         {"role": "user", "content": "so?"}]
    third, _, _ = ask(ep, mixed)
    assert third is not second and ep.counts["unappendable_messages"] == 1
    trajs = ep.finish(AgentOutcome(0.75), failed=False)
    assert [t.traj_id for t in trajs] == [7, EXTRA_SAMPLE_ID_BASE + 7 * 64 + 1,
                                          EXTRA_SAMPLE_ID_BASE + 7 * 64 + 2]
    # Segments of one episode: the reward once, on the last that has a reply (the third
    # has none yet), so the episode is one member of its group, not three.
    assert [t.segment for t in trajs] == [0, 1, 2]
    assert [t.score for t in trajs] == [0.0, 0.75, 0.0]
    assert all((t.group_id, t.member, t.seed, t.terminated) == (2, 1, 4, True) for t in trajs)
    # ... and one episode in the logged means: success and return once, its turns summed.
    other = dataclasses.replace(trajs[1], member=0, segment=0, metrics={})
    other.turns = [dataclasses.replace(u, reward=0.0, success=False) for u in other.turns]
    set_episode_metrics(trajs + [other])
    logged = trajectory_metrics(trajs + [other], "env/")
    assert (logged["env/success"], logged["env/return"], logged["env/num_turns"]) == (
        0.5, 0.375, 1.5)


def test_turn_rewards_land_on_the_replies_in_the_order_answered(tokenizer):
    """An agent's dict outcome: one turn reward per reply, across a rewritten history's
    segments, the episode's reward added on the last; `success` as the agent says."""
    ep = episode(tokenizer)
    chat = [SYSTEM, {"role": "user", "content": "What is 2 + 3?"}]
    first, _, ctx = ask(ep, chat)
    reply(ep, tokenizer, first, ctx, "It is 6.")
    second, _, ctx2 = ask(ep, chat + [first.messages[-1], {"role": "user", "content": "No."}])
    assert second is first
    reply(ep, tokenizer, second, ctx2, "It is 5.")
    rewritten = chat + [{"role": "user", "content": "Once more."}]
    third, _, ctx3 = ask(ep, rewritten)
    assert third is not first
    reply(ep, tokenizer, third, ctx3, "5")
    trajs = ep.finish(AgentOutcome(1.0, success=False, turn_rewards=(-0.1, 0.2, 0.3)),
                      failed=False)
    assert [[u.reward for u in t.turns] for t in trajs] == [[-0.1, 0.2], [1.3]]
    assert [u.success for t in trajs for u in t.turns] == [False, False, False]


def test_a_prompt_over_the_length_limit_is_a_400_and_truncates(tokenizer):
    from jaxrl_agentic.serving.protocol import RequestError

    ep = episode(tokenizer, max_input_length=20)
    with pytest.raises(RequestError) as e:
        ask(ep, [{"role": "user", "content": "long " * 50}], tools=None)
    assert e.value.code == "context_length_exceeded"
    assert ep.samples[0].trajectory.truncated_by_length
