"""The endpoint over HTTP: OpenAI's errors for bad requests, the `openai` client's tool-call
round trip, many agents at once attributed to their own episodes, and the tokens and
logprobs each trajectory records are the ones the sampler drew."""

import json
import math
import urllib.error
import urllib.request
from concurrent.futures import Future

import numpy as np
import pytest

from jaxrl_agentic.envs.outside_agent import outside_agent_factory
from jaxrl_agentic.envs.tools import format_tool_call
from jaxrl_agentic.rollout.conversation import ChatFormatter
from jaxrl_agentic.rollout.groups import EpisodeSpec
from jaxrl_agentic.rollout.turns import GenerationConfig, turn_seed
from jaxrl_agentic.serving import AgentRolloutRunner
from jaxrl_agentic.warmup import ScriptedSampler

pytest.importorskip("aiohttp")
MAX_NEW = 6


def post(url, body, key=None, raw=None):
    """(status, decoded JSON) of a POST."""
    data = raw if raw is not None else json.dumps(body).encode()
    request = urllib.request.Request(url, data=data, method="POST",
                                     headers={"Content-Type": "application/json"})
    if key:
        request.add_header("Authorization", f"Bearer {key}")
    try:
        with urllib.request.urlopen(request, timeout=60) as r:
            return r.status, json.loads(r.read())
    except urllib.error.HTTPError as e:
        return e.code, json.loads(e.read())


def runner(sampler, tokenizer, server, agent, *, tasks=("a",), slots=0, max_turns=6):
    return AgentRolloutRunner(outside_agent_factory(agent_fn=agent, tasks=list(tasks)),
                              sampler, tokenizer, tag="agent", max_turns=max_turns,
                              max_input_length=200, slots=slots, server=server,
                              generation=GenerationConfig(max_tokens_per_step=MAX_NEW))


def test_bad_requests_get_openai_errors(server):
    calls = []

    def submit(request):
        calls.append(request)
        done = Future()
        done.set_result({"id": "x", "object": "chat.completion", "choices": []})
        return done

    key = server.open_episode(submit)
    url = server.base_url(key) + "/chat/completions"
    ok = {"model": "m", "messages": [{"role": "user", "content": "hi"}]}
    assert post(url, ok)[0] == 200
    assert post(server.url + "/v1/chat/completions", ok, key=key)[0] == 200  # key route
    for body, raw, status, code in [
            (dict(ok, n=2), None, 400, "unsupported_value"),
            (None, b"{not json", 400, "invalid_json"),
            ({"messages": "hi"}, None, 400, "invalid_value")]:
        got, error = post(url, body, raw=raw)
        assert (got, error["error"]["code"]) == (status, code)
        assert error["error"]["type"] == "invalid_request_error"
    status, error = post(server.base_url("f" * 24) + "/chat/completions", ok)
    assert (status, error["error"]["code"]) == (404, "episode_not_found")
    status, error = post(server.url + "/v1/chat/completions", ok)
    assert (status, error["error"]["code"]) == (401, "invalid_api_key")
    with urllib.request.urlopen(server.base_url(key) + "/models", timeout=60) as r:
        assert json.loads(r.read())["data"][0]["id"] == server.model_name
    assert len(calls) == 2  # only the good requests reached the episode
    server.close_episode(key)
    assert post(url, ok)[0] == 404


def test_openai_client_tool_call_round_trip(tiny, server):
    openai = pytest.importorskip("openai")
    _, tok = tiny
    formatter = ChatFormatter(tok)
    call_ids = formatter.reply_ids(format_tool_call("add", {"a": 2, "b": 3}))
    seen = []

    def policy(row, new_ids):  # calls the tool, then answers with what it returned
        seen.append(tok.decode(new_ids))
        if len(seen) == 1:
            return call_ids
        answer = seen[-1].split("<tool_response>\n")[1].split("\n</tool_response>")[0]
        return formatter.reply_ids(f"The sum is {answer}.")

    tools = [{"type": "function", "function": {"name": "add", "parameters": {
        "type": "object", "properties": {"a": {"type": "number"}, "b": {"type": "number"}}}}}]

    def agent(base_url, api_key, task):
        client = openai.OpenAI(base_url=base_url, api_key=api_key, max_retries=0)
        messages = [{"role": "user", "content": task}]
        while True:
            r = client.chat.completions.create(model="policy", messages=messages, tools=tools)
            message = r.choices[0].message
            messages.append(message.model_dump())
            if not message.tool_calls:
                return float(message.content == "The sum is 5.")
            assert r.choices[0].finish_reason == "tool_calls"
            for c in message.tool_calls:
                args = json.loads(c.function.arguments)
                messages.append({"role": "tool", "tool_call_id": c.id,
                                 "content": str(args["a"] + args["b"])})

    scripted = ScriptedSampler(policy, max_total_len=4096)
    r = AgentRolloutRunner(outside_agent_factory(agent_fn=agent, tasks=["What is 2 + 3?"]),
                           scripted, tok, tag="agent", max_turns=4, max_input_length=1000,
                           server=server,
                           generation=GenerationConfig(max_tokens_per_step=64))
    (traj,) = r.run([EpisodeSpec(seed=0, group_id=0, member=0)], sample_seed=0)
    assert traj.score == 1.0 and traj.terminated and r.stats["rewritten_histories"] == 0
    assert [t.generated for t in traj.turns] == [call_ids,
                                                 formatter.reply_ids("The sum is 5.")]
    assert "What is 2 + 3?" in seen[0] and "<tool_response>\n5\n</tool_response>" in seen[1]


def test_concurrent_agents_get_their_own_episodes_and_the_samplers_tokens(tiny, server):
    sampler, tok = tiny
    got = {}  # task -> the (content, logprobs) of each reply it received

    def agent(base_url, api_key, task):
        messages, replies = [{"role": "user", "content": f"Task {task}."}], []
        for _ in range(2):
            status, body = post(base_url + "/chat/completions",
                                {"messages": messages, "logprobs": True})
            assert status == 200, body
            message = body["choices"][0]["message"]
            replies.append((message["content"], [t["logprob"] for t in
                                                 body["choices"][0]["logprobs"]["content"]]))
            messages += [message, {"role": "user", "content": "More."}]
        got[task] = replies
        return float(len(task))

    tasks = ["Left", "Right", "Up", "Down"]
    r = runner(sampler, tok, server, agent, tasks=tasks, slots=2)  # rows are shared
    specs = [EpisodeSpec(seed=2 * s, group_id=s, member=0) for s in range(4)]  # tasks[s]
    trajs = r.run(specs, sample_seed=11, traj_id_start=20)
    assert [t.traj_id for t in trajs] == [20, 21, 22, 23] and r.stats["requests"] == 8
    for traj, task in zip(trajs, tasks, strict=True):
        assert f"Task {task}." in tok.decode(traj.tokens[:traj.turns[0].context_len])
        assert traj.score == len(task) and len(traj.turns) == 2
        for turn, (content, logprobs) in zip(traj.turns, got[task], strict=True):
            assert content == tok.decode(turn.generated, skip_special_tokens=True)
            np.testing.assert_array_equal(np.float32(logprobs), turn.logprobs)
            # The sampler alone, on the recorded context, draws the recorded tokens.
            session = sampler.new_session(1)
            session.extend([0], [traj.tokens[:turn.context_len]])
            ref = session.generate([0], max_new_tokens=MAX_NEW, seed=turn_seed(11, 0 if
                                   turn is traj.turns[0] else 1), row_seeds=[traj.traj_id])
            assert ref.tokens[0] == turn.generated
            np.testing.assert_allclose(ref.logprobs[0], turn.logprobs, atol=1e-5)
            assert traj.tokens[turn.context_len:turn.context_len + len(turn.generated)] == \
                turn.generated


def test_rewrites_failures_and_caps_are_counted(tiny, server):
    sampler, tok = tiny

    def agent(base_url, api_key, task):
        url = base_url + "/chat/completions"
        if task == "raise":
            raise RuntimeError("the agent broke")
        first = [{"role": "user", "content": "Go."}]
        _, body = post(url, {"messages": first, "max_tokens": 2})
        assert body["choices"][0]["finish_reason"] == "length"
        if task == "nan":
            return math.nan
        # A summary instead of our reply: a new sample of the same episode.
        post(url, {"messages": first + [{"role": "assistant", "content": "(summary)"},
                                        {"role": "user", "content": "Go on."}]})
        return 0.5

    r = runner(sampler, tok, server, agent, tasks=["rewrite", "raise", "nan"])
    trajs = r.run([EpisodeSpec(seed=2 * s, group_id=s, member=0) for s in range(3)],
                  sample_seed=0)
    rewrite, raised, nan, second = trajs
    assert r.stats["rewritten_histories"] == 1 and r.stats["failures"] == 2
    assert rewrite.metrics["agent/rewritten_histories"] == 1.0 == rewrite.metrics[
        "agent/samples"] - 1
    # One episode in two segments: the reward once, on the second.
    assert (rewrite.score, second.score, rewrite.group_id, second.group_id) == (0.0, 0.5, 0, 0)
    assert (rewrite.segment, second.segment) == (0, 1)
    assert len(rewrite.turns[0].generated) == 2  # max_tokens cut the reply
    assert raised.turns == [] and raised.truncated and raised.metrics["agent/failures"] == 1.0
    assert nan.score == 0.0 and nan.truncated and nan.metrics["agent/failures"] == 1.0
