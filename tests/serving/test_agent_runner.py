"""The rollout of outside agents at scale and past their deadlines: 32 `openai` clients at
once, each request attributed to its own episode and decoded with the others' (fewer
sampler calls than requests), every trajectory's loss mask exactly on the tokens its client
was sent; an agent that runs past `agent_timeout_s` is abandoned — reward 0, counted in
``agent/timeouts``, its later requests refused — while the others play on unchanged; and
docs/extending.md's agent and recipe, run as written."""

import concurrent.futures
import json
import os
import re
import sys
import threading
import time
import types
import urllib.error
import urllib.request

import numpy as np
import pytest

from jaxrl_agentic.config import validate
from jaxrl_agentic.envs.outside_agent import agent_metrics, outside_agent_factory
from jaxrl_agentic.rollout.conversation import ChatFormatter
from jaxrl_agentic.rollout.groups import EpisodeSpec
from jaxrl_agentic.rollout.turns import GenerationConfig, turn_seed
from jaxrl_agentic.sampling import SlotDecoder
from jaxrl_agentic.serving import AgentRolloutRunner
from jaxrl_agentic.warmup import ScriptedSampler

pytest.importorskip("aiohttp")
MAX_NEW = 4
AGENTS = 32


def runner(sampler, tokenizer, server, factory, *, slots=0):
    return AgentRolloutRunner(factory, sampler, tokenizer, tag="agent", max_turns=4,
                              max_input_length=200, slots=slots, server=server,
                              generation=GenerationConfig(max_tokens_per_step=MAX_NEW))


def played(r, specs, **kwargs):
    """`r.run(specs)` on a thread: a rollout that hangs fails the test instead of blocking."""
    with concurrent.futures.ThreadPoolExecutor(1) as pool:
        return pool.submit(r.run, specs, **kwargs).result(timeout=300)


def test_32_openai_clients_at_once_decode_together_each_in_its_own_episode(
        tiny, server, monkeypatch):
    openai = pytest.importorskip("openai")
    sampler, tok = tiny
    chunks = []  # the rows of every decode chunk the sampler ran
    run_chunk = SlotDecoder._run_chunk_program

    def counted(self, params, block, live, width):
        chunks.append(len(live))
        return run_chunk(self, params, block, live, width)

    monkeypatch.setattr(SlotDecoder, "_run_chunk_program", counted)
    ready = threading.Barrier(AGENTS, timeout=120)  # every client built, then all ask
    got = {}  # task -> per turn: (content, [(token text, logprob)], completion_tokens)

    def agent(base_url, api_key, task):
        """Two requests; between them the agent runs its tool and sends the result (its
        own, naming its task) as a tool message. (No `tools` listed: their schema alone is
        longer than the tiny model's context.)"""
        client = openai.OpenAI(base_url=base_url, api_key=api_key, max_retries=0)
        messages, replies = [{"role": "user", "content": f"Task {task}: look it up."}], []
        ready.wait()
        for turn in range(2):
            r = client.chat.completions.create(model="policy", messages=messages,
                                               logprobs=True)
            choice = r.choices[0]
            replies.append((choice.message.content,
                            [(c.token, c.logprob) for c in choice.logprobs.content],
                            r.usage.completion_tokens))
            messages += [choice.message.model_dump(),
                         {"role": "tool", "tool_call_id": f"call_{turn}",
                          "content": f"value of {task} is {int(task) * 7}"}]
        got[task] = replies
        return float(int(task))

    tasks = [f"{i:02d}" for i in range(AGENTS)]
    # 8 rows for 32 agents: rows are handed from sample to sample (the least recently used
    # idle one), whose next prompt then prefills its whole stream again.
    r = runner(sampler, tok, server, outside_agent_factory(agent_fn=agent, tasks=tasks),
               slots=8)
    specs = [EpisodeSpec(seed=2 * i, group_id=i, member=0) for i in range(AGENTS)]
    before = dict(sampler.stats)
    trajs = played(r, specs, sample_seed=5, traj_id_start=100)
    requests = 2 * AGENTS
    assert (r.stats["requests"], r.stats["failures"], r.stats["timeouts"],
            r.stats["rewritten_histories"], r.stats["samples"]) == (requests, 0, 0, 0, AGENTS)
    assert [t.traj_id for t in trajs] == list(range(100, 100 + AGENTS))

    # Decoded together: fewer chunks and prefills than requests, chunks of several rows.
    prefills = sampler.stats["prefill_calls"] - before["prefill_calls"]
    steps = sampler.stats["decode_steps"] - before["decode_steps"]
    generated = sum(len(turn.generated) for t in trajs for turn in t.turns)
    assert len(chunks) < requests and prefills < requests and steps < generated
    assert max(chunks) > 1 and sum(chunks) > len(chunks)

    for i, (traj, task) in enumerate(zip(trajs, tasks, strict=True)):
        assert traj.score == float(i) and traj.terminated and len(traj.turns) == 2
        text = tok.decode(traj.tokens)
        # Its own task and tool result, nobody else's.
        assert [t for t in tasks if f"Task {t}:" in text] == [task]
        assert [t for t in tasks if f"value of {t} is" in text] == [task]
        first, second = traj.turns
        assert f"Task {task}:" in tok.decode(traj.tokens[:first.context_len])
        assert f"value of {task} is {i * 7}" in tok.decode(
            traj.tokens[first.context_len:second.context_len])
        sent = got[task]
        for turn, (content, token_logprobs, completion_tokens) in zip(traj.turns, sent,
                                                                      strict=True):
            assert content == tok.decode(turn.generated, skip_special_tokens=True)
            assert [t for t, _ in token_logprobs] == [tok.decode([x]) for x in turn.generated]
            np.testing.assert_array_equal(np.float32([lp for _, lp in token_logprobs]),
                                          turn.logprobs)
            assert completion_tokens == len(turn.generated)
        # The loss mask is 1 on exactly the tokens the client was sent, in order, and
        # their logprobs are the ones it was sent.
        mask = traj.loss_mask().astype(bool)
        sent_tokens = [t for _, tl, _ in sent for t, _ in tl]
        assert [tok.decode([x]) for x in np.asarray(traj.tokens)[mask]] == sent_tokens
        assert mask.sum() == sum(n for _, _, n in sent)
        np.testing.assert_array_equal(traj.stream_logprobs()[mask],
                                      np.float32([lp for _, tl, _ in sent for _, lp in tl]))
        for turn in traj.turns:  # the prompt and an EOS the model did not draw: mask 0
            assert not mask[:turn.context_len][-1]
            if turn.eos_appended:
                assert not mask[turn.context_len + len(turn.generated)]
    # Rows shared by several samples still draw what the sampler alone draws on the
    # recorded context (a sample whose row was taken re-prefilled its whole stream).
    for traj in (trajs[0], trajs[AGENTS // 2], trajs[-1]):
        for k, turn in enumerate(traj.turns):
            session = sampler.new_session(1)
            session.extend([0], [traj.tokens[:turn.context_len]])
            ref = session.generate([0], max_new_tokens=MAX_NEW, seed=turn_seed(5, k),
                                   row_seeds=[traj.traj_id])
            assert ref.tokens[0] == turn.generated
            np.testing.assert_allclose(ref.logprobs[0], turn.logprobs, atol=1e-5)


def _status(url: str, body: dict | None = None) -> int:
    data = None if body is None else json.dumps(body).encode()
    request = urllib.request.Request(url, data=data, method="GET" if body is None else "POST",
                                     headers={"Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(request, timeout=60) as reply:
            reply.read()
            return reply.status
    except urllib.error.HTTPError as e:
        return e.code


def _ask(base_url: str, messages: list[dict]) -> dict:
    request = urllib.request.Request(base_url + "/chat/completions", method="POST",
                                     data=json.dumps({"messages": messages}).encode(),
                                     headers={"Content-Type": "application/json"})
    with urllib.request.urlopen(request, timeout=60) as reply:
        return json.loads(reply.read())["choices"][0]["message"]


def test_an_agent_past_its_deadline_gets_reward_0_and_the_others_play_on(
        tiny, server, caplog):
    sampler, tok = tiny
    release, late = threading.Event(), concurrent.futures.Future()
    stuck_url, stuck_waits = [], threading.Event()  # for the others to watch it

    def agent(base_url, api_key, task):
        if task == "stuck":  # waits (on the test, not a clock) past its deadline
            stuck_url.append(base_url)
            stuck_waits.set()
            release.wait(timeout=120)
            late.set_result(_status(base_url + "/chat/completions",
                                    {"messages": [{"role": "user", "content": "Go."}]}))
            return 1.0
        messages = [{"role": "user", "content": f"Task {task}."}]
        messages += [_ask(base_url, messages), {"role": "user", "content": "More."}]
        stuck_waits.wait(timeout=60)  # the second request once the stuck episode has ended
        while _status(stuck_url[0] + "/models") != 404:
                time.sleep(0.005)
        _ask(base_url, messages)
        return 0.5

    tasks = ["stuck", "a", "b", "c"]
    base = outside_agent_factory(agent_fn=agent, tasks=tasks, agent_timeout_s=120)
    tiny_timeout = outside_agent_factory(agent_fn=agent, tasks=tasks, agent_timeout_s=0.01)

    def factory(spec, run_seed):
        """`agent_timeout_s` is the env_config's; only the stuck episode gets the tiny one,
        so a slow machine cannot time the others out."""
        return (tiny_timeout if spec.seed == 0 else base)(spec, run_seed)

    specs = [EpisodeSpec(seed=2 * i, group_id=i, member=0) for i in range(4)]
    r = runner(sampler, tok, server, factory)
    with caplog.at_level("WARNING", logger="jaxrl_agentic.serving.agent_runner"):
        trajs = played(r, specs, sample_seed=3, traj_id_start=40)
    stuck, others = trajs[0], trajs[1:]
    assert (r.stats["timeouts"], r.stats["failures"], r.stats["requests"]) == (1, 0, 6)
    assert "agent_timeout_s=0.01; reward 0 (agent/timeouts)" in caplog.text
    assert agent_metrics([t.metrics for t in trajs])["agent/timeouts"] == 1.0
    # The fallback: no turns (it never asked), reward 0, truncated, not terminated.
    assert stuck.turns == [] and stuck.score == 0.0 and stuck.truncated
    assert not stuck.terminated and stuck.metrics["agent/timeouts"] == 1.0
    assert all(t.metrics["agent/timeouts"] == 0.0 for t in others)
    release.set()  # its request after the deadline: the episode is gone
    assert late.result(timeout=60) == 404
    # The others: whole, rewarded, and token for token what they play without it.
    assert all(t.terminated and t.score == 0.5 and len(t.turns) == 2 for t in others)
    alone = played(runner(sampler, tok, server, base), specs[1:], sample_seed=3,
                   traj_id_start=41)
    assert [(t.traj_id, t.tokens) for t in others] == [(t.traj_id, t.tokens) for t in alone]


def test_the_agent_and_recipe_of_docs_extending_run_as_written(tiny, server, monkeypatch):
    pytest.importorskip("openai")
    _, tok = tiny
    root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    with open(os.path.join(root, "docs", "extending.md")) as f:
        section = f.read().split("## Train an agent you already have\n")[1].split("\n## ")[0]
    agent_code, recipe_code = re.findall(r"```python\n(.*?)```", section, re.S)
    my_agents = types.ModuleType("my_agents")
    exec(agent_code, my_agents.__dict__)
    monkeypatch.setitem(sys.modules, "my_agents", my_agents)  # the recipe's "my_agents:solve"
    recipe = {}
    exec(recipe_code, recipe)
    c = recipe["get_config"]()
    validate(c)
    spec = c.custom_envs.qa
    answer = ChatFormatter(tok).reply_ids("The sum is 5.")
    r = AgentRolloutRunner(outside_agent_factory(**spec.env_config),
                           ScriptedSampler(lambda row, new_ids: answer, max_total_len=4096),
                           tok, tag="qa", max_turns=spec.max_turns, max_input_length=1000,
                           server=server, generation=GenerationConfig(
                               max_tokens_per_step=spec.max_tokens_per_step))
    # Seeds 0 and 2 play the two tasks in order: "2 + 3" is answered right, "7 + 8" not.
    trajs = r.run([EpisodeSpec(seed=2 * i, group_id=i, member=0) for i in range(2)],
                  sample_seed=0)
    assert [t.score for t in trajs] == [1.0, 0.0] and r.stats["requests"] == 2
    assert all(t.terminated and len(t.turns) == 1 for t in trajs)
    assert "What is 7 + 8?" in tok.decode(trajs[1].tokens)


def test_an_async_agents_dict_sets_turn_rewards_and_a_miscount_fails_the_episode(
        tiny, server, caplog):
    _, tok = tiny
    reply = ChatFormatter(tok).reply_ids("Fine.")

    async def agent(base_url, api_key, task):
        import asyncio

        messages = [{"role": "user", "content": "Go."}]
        for _ in range(2):  # the blocking client on a worker thread: the loop stays free
            messages += [await asyncio.to_thread(_ask, base_url, messages),
                         {"role": "user", "content": "Again."}]
        return {"reward": 1.0, "success": False, "metrics": {"depth": float(len(task))},
                "turn_rewards": [0.25] * len(task)}  # "ab": one per reply; "abc": one too many

    r = AgentRolloutRunner(outside_agent_factory(agent_fn=agent, tasks=["ab", "abc"]),
                           ScriptedSampler(lambda row, new_ids: reply, max_total_len=4096),
                           tok, tag="agent", max_turns=4, max_input_length=200,
                           server=server, generation=GenerationConfig(max_tokens_per_step=4))
    with caplog.at_level("WARNING", logger="jaxrl_agentic.serving.agent_runner"):
        good, bad = played(r, [EpisodeSpec(seed=2 * i, group_id=i, member=0)
                               for i in range(2)], sample_seed=0)
    assert [u.reward for u in good.turns] == [0.25, 1.25] and not good.metrics["success"]
    assert good.terminated and not bad.terminated and bad.score == 0.0
    assert r.stats["failures"] == 1 and "3 turn_rewards for 2 replies" in caplog.text
    assert agent_metrics([good.metrics, bad.metrics])["agent_metric/depth"] == 2.0


def _gathering(think_s, asked=(), ended=()):
    """A rollout of 3 episodes stopped before its loop: its inbox holds a request of every
    episode not in `asked` or `ended`; `_take` is the identity on them."""
    import queue

    from jaxrl_agentic.serving.agent_runner import _Rollout

    rollout = _Rollout.__new__(_Rollout)
    rollout.specs, rollout.outcomes = [None] * 3, {i: ("ok", 0.0) for i in ended}
    rollout.think_s, rollout.inbox = list(think_s), queue.SimpleQueue()
    rollout._take = lambda message: (message[1], "sample")
    for i in range(3):
        if i not in asked and i not in ended:
            rollout.inbox.put(("request", i, None, None))
    return rollout


def test_requests_about_to_come_join_the_chunk_unless_the_agents_are_slow():
    """Agents that answer fast (or have just started) are waited for, so their requests
    start on the same decode chunk: at a real model's shape this took the endpoint's
    overhead from 0.49 to 0.18 (docs/benchmarks.md). Agents whose median time between a
    reply and the next request is over the window are not waited for at all."""
    waiting = [(0, "sample")]  # episode 0 has a request waiting for a row
    fast = _gathering([0.001, 0.002], asked=(0,))
    assert sorted(fast._gather(waiting, {})) == [(1, "sample"), (2, "sample")]
    started = _gathering([], asked=(0,))  # no reply yet: the first requests are waited for
    assert len(started._gather(waiting, {})) == 2
    slow = _gathering([1.0, 2.0], asked=(0,))
    assert slow._gather(waiting, {}) == [] and not slow.inbox.empty()  # taken next loop
    # Nobody about to ask: episode 1 decoding, episode 2 ended.
    busy = _gathering([0.001], asked=(0, 1), ended=(2,))
    assert busy._gather(waiting, {(1, 0): None}) == []
