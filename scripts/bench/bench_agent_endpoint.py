"""Outside agents through the OpenAI-compatible endpoint vs the in-process environment loop,
on the same episodes, side by side in one run.

The task is a two-turn tool exchange, written twice:

- **in process**: a `PythonTextEnv` whose first message is "Task <seed>. Look it up.",
  whose first step answers with a tool result ("value of <seed> is <7·seed>", the chat's
  `tool` role) and whose second step ends the episode; played by `PythonRolloutRunner`
  with continuous batching (`batching="continuous"`, the slot decoder).
- **endpoint**: an agent function that sends the same messages with the real `openai`
  client (an `openai.OpenAI` per episode, on its `base_url`, over HTTP on 127.0.0.1): the
  user message, the reply as it came back plus the same tool result, then stops; played
  by `AgentRolloutRunner` (the endpoint always decodes with the slot decoder). The
  episodes' clients share one connection pool (`http_client=openai.DefaultHttpxClient()`):
  a client built with its own builds an SSL context, 0.07–0.14 s of the agent's CPU on
  the dev machine even for plain http, which is the agent's cost, not the endpoint's
  (`--client-per-episode` measures it too).

Both use the same sampler, `--slots` rows (0: one per episode), `--chunk` decode steps per
chunk, `--new-tokens` tokens a reply at most, the same episode seeds and sampling seeds.
The tokens are then the same on both sides (`same_tokens` checks every trajectory's
stream; `endpoint_tokens` and `in_process_tokens` count the generated ones), so the work
is equal and only the path differs: HTTP, JSON, the client, the endpoint's continuation
matching and tokenising on the endpoint side; a direct call into the environment on the
other. The untrained model rarely writes EOS, so most replies are `--new-tokens` long
(the sampler has no minimum length; the counts say what was generated).

Each side plays one untimed warm-up rollout (compiles the slot grid), then `--repeats`
timed ones, the two sides alternating (and which goes first alternating) so both see
the same background load; medians are reported.

    overhead              = endpoint_s / in_process_s − 1    (the goal: ≤ 0.20)
    ms_per_request        = (endpoint_s − in_process_s) / requests · 1000
    agent_cpu_ms_per_request   = CPU time of the agents' threads (the openai client's
                                 work: request, JSON, HTTP, parsing) per request
    server_cpu_ms_per_request  = CPU time of the endpoint's aiohttp thread per request
                                 (/proc, 10 ms ticks: a rough figure)
    <side>_tokens_per_s   = generated tokens / that side's median wall time
    <side>_requests_per_s = replies (requests, in process: turns) / that side's median wall time

    python scripts/bench/bench_agent_endpoint.py
    python scripts/bench/bench_agent_endpoint.py --episodes 64 --new-tokens 32 --repeats 5

Prints ONE JSON line.
"""
from __future__ import annotations

import argparse
import functools
import json
import os
import statistics
import sys
import threading
import time

import common

DEVICE = common.configure()  # before jax is imported

sys.path.insert(0, common.ROOT)

from jaxrl_agentic.envs.outside_agent import outside_agent_factory  # noqa: E402
from jaxrl_agentic.envs.python_env import PyStep, PythonTextEnv, text_state_hash  # noqa: E402
from jaxrl_agentic.models import load_pretrained  # noqa: E402
from jaxrl_agentic.models.tiny import default_tiny_model_dir  # noqa: E402
from jaxrl_agentic.rollout.conversation import ChatFormatter  # noqa: E402
from jaxrl_agentic.rollout.groups import EnvManagerConfig, plan_episodes  # noqa: E402
from jaxrl_agentic.rollout.python_runner import PythonRolloutRunner  # noqa: E402
from jaxrl_agentic.rollout.turns import GenerationConfig  # noqa: E402
from jaxrl_agentic.sampling import Sampler  # noqa: E402
from jaxrl_agentic.serving import AgentRolloutRunner  # noqa: E402

TURNS = 2


def first_message(seed: int) -> str:
    return f"Task {seed}. Look it up."


def tool_result(seed: int) -> str:
    return f"value of {seed} is {7 * seed}"


class LookupEnv(PythonTextEnv):
    """The in-process side: a tool result after the first reply, the end after the second."""

    max_steps_in_episode = TURNS

    def __init__(self, spec, run_seed: int):
        self.spec, self.t = spec, 0

    def reset(self, seed: int) -> str:
        self.t = 0
        return first_message(seed)

    def step(self, reply: str) -> PyStep:
        self.t += 1
        done = self.t >= TURNS
        return PyStep(observation="", reward=0.0, terminated=done, action_is_valid=True,
                      action_is_effective=True, success=False, action=0,
                      tool_messages=() if done else (tool_result(self.spec.seed),))

    def state_hash(self) -> bytes:
        return text_state_hash(f"{self.spec.seed}/{self.spec.member}/{self.t}")


_HTTP = {}  # the http client the agents share (--client-per-episode: none)
AGENT_CPU = [0.0]  # CPU seconds the agents' threads spent (their client's work)
_HTTP_LOCK = threading.Lock()


def shared_http_client():
    """One connection pool for every episode's `openai.OpenAI` (a new client would build
    an SSL context, 0.07–0.14 s on the dev machine, even for plain http)."""
    import openai

    with _HTTP_LOCK:
        if "client" not in _HTTP:
            _HTTP["client"] = openai.DefaultHttpxClient()
        return _HTTP["client"]


def lookup_agent(base_url: str, api_key: str, task, *, own_client: bool = False) -> float:
    """The endpoint side: the same messages through the `openai` client (`task` = seed)."""
    import openai

    start = time.thread_time()
    http = None if own_client else shared_http_client()
    client = openai.OpenAI(base_url=base_url, api_key=api_key, max_retries=0,
                           http_client=http)
    messages = [{"role": "user", "content": first_message(task)}]
    for turn in range(TURNS):
        reply = client.chat.completions.create(model="policy", messages=messages)
        if turn + 1 < TURNS:
            messages += [reply.choices[0].message.model_dump(),
                         {"role": "tool", "tool_call_id": "call_0",
                          "content": tool_result(task)}]
    if own_client:
        client.close()
    with _HTTP_LOCK:
        AGENT_CPU[0] += time.thread_time() - start
    return 0.0


def server_cpu_s() -> float:
    """CPU seconds of the endpoint's thread so far (Linux: /proc/self/task/<tid>/stat)."""
    (thread,) = [t for t in threading.enumerate() if t.name == "openai-endpoint"]
    with open(f"/proc/self/task/{thread.native_id}/stat") as f:
        fields = f.read().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")  # utime + stime


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--device", default="cpu", choices=["cpu", "gpu"])
    parser.add_argument("--model", default="", help="HF model directory (default: tiny)")
    parser.add_argument("--episodes", type=int, default=32)
    parser.add_argument("--new-tokens", type=int, default=16)
    parser.add_argument("--slots", type=int, default=0)
    parser.add_argument("--chunk", type=int, default=8)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--client-per-episode", action="store_true",
                        help="each episode's agent builds its own http client (module doc)")
    parser.add_argument("--compilation-cache", default="",
                        help="a JAX persistent compilation cache directory (faster reruns)")
    args = parser.parse_args()
    common.check_flag(parser, args.device, DEVICE)
    if args.episodes < 2 or args.episodes % 2 or args.repeats < 1:
        parser.error("--episodes must be even and >= 2 (groups of 2), --repeats >= 1")

    if args.compilation_cache:
        import jax

        jax.config.update("jax_compilation_cache_dir", args.compilation_cache)
    model, tok = load_pretrained(args.model or default_tiny_model_dir())
    formatter = ChatFormatter(tok)
    max_input_length = 96 + 2 * args.new_tokens  # the two prompts and the first reply
    sampler = Sampler(model, tok, max_total_len=max_input_length + args.new_tokens + 1)
    plan = plan_episodes(EnvManagerConfig(num_env_groups=args.episodes // 2, group_size=2,
                                          tags=("bench",)), split="train", cursor=0)["bench"]
    generation = GenerationConfig(max_tokens_per_step=args.new_tokens)
    settings = dict(tag="bench", max_turns=TURNS, max_input_length=max_input_length,
                    generation=generation, slots=args.slots, decode_chunk=args.chunk)
    # no tasks / task_fn: an episode's task is its seed, as LookupEnv's reset gets
    agents = outside_agent_factory(agent_fn=functools.partial(
        lookup_agent, own_client=args.client_per_episode))
    runners = {
        "in_process": PythonRolloutRunner(LookupEnv, sampler, formatter,
                                          batching="continuous", **settings),
        "endpoint": AgentRolloutRunner(agents, sampler, tok, **settings),
    }
    for r in runners.values():  # warm-up: compiles, starts the server
        r.run(plan, sample_seed=0)
    times = {name: [] for name in runners}
    tokens = {name: 0 for name in runners}
    same = True
    AGENT_CPU[0], server_start = 0.0, server_cpu_s()
    for repeat in range(args.repeats):
        order = list(runners) if repeat % 2 == 0 else list(runners)[::-1]
        streams = {}
        for name in order:
            start = time.perf_counter()
            trajs = runners[name].run(plan, sample_seed=1 + repeat)
            times[name].append(time.perf_counter() - start)
            tokens[name] += sum(len(u.generated) for t in trajs for u in t.turns)
            streams[name] = [(t.traj_id, t.tokens) for t in trajs]
        same = same and streams["endpoint"] == streams["in_process"]
    agent_cpu, server_cpu = AGENT_CPU[0], server_cpu_s() - server_start
    stats = runners["endpoint"].stats
    if stats["failures"] or stats["timeouts"] or stats["rewritten_histories"]:
        raise SystemExit(f"the endpoint's agents did not play cleanly: {stats}")
    median = {name: statistics.median(ts) for name, ts in times.items()}
    requests = args.episodes * TURNS
    print(json.dumps({
        "bench": "agent_endpoint",
        "device": DEVICE,
        "model": args.model or "tiny",
        "episodes": args.episodes,
        "turns": TURNS,
        "requests_per_rollout": requests,
        "max_new_tokens": args.new_tokens,
        "slots": args.slots or args.episodes,
        "chunk": args.chunk,
        "decode_threads": sampler.decode_threads,
        "endpoint_s": round(median["endpoint"], 3),
        "in_process_s": round(median["in_process"], 3),
        "overhead": round(median["endpoint"] / median["in_process"] - 1, 3),
        "ms_per_request": round((median["endpoint"] - median["in_process"]) / requests * 1e3,
                                2),
        "endpoint_requests_per_s": round(requests / median["endpoint"], 2),
        "in_process_requests_per_s": round(requests / median["in_process"], 2),
        "endpoint_tokens": tokens["endpoint"],
        "in_process_tokens": tokens["in_process"],
        "endpoint_tokens_per_s": round(tokens["endpoint"] / args.repeats
                                       / median["endpoint"], 1),
        "in_process_tokens_per_s": round(tokens["in_process"] / args.repeats
                                         / median["in_process"], 1),
        "same_tokens": same,
        # CPU per request on the endpoint side, beside the decoding both sides do: the
        # agents' client (request, JSON, HTTP, response parsing) and the HTTP server thread
        "agent_cpu_ms_per_request": round(agent_cpu / args.repeats / requests * 1e3, 2),
        "server_cpu_ms_per_request": round(server_cpu / args.repeats / requests * 1e3, 2),
        **{f"{name}_times_s": [round(t, 3) for t in ts] for name, ts in times.items()},
        "http_client": "per_episode" if args.client_per_episode else "shared",
        "repeats": args.repeats,
        "loadavg_1m": round(os.getloadavg()[0], 2),
    }))


if __name__ == "__main__":
    main()
