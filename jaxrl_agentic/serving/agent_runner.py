"""Rollouts of outside agents (`openai_agent`): each episode's agent runs on a thread,
pointed at its own base_url of the endpoint, and the trainer's policy answers it.

    run(episodes):
        open one endpoint episode per spec (its key: URL path segment and API key)
        start agent_fn(base_url, key, task) on a thread per episode
        until every agent has returned (or run past agent_timeout_s):
            take the requests that came in    → the sample they extend, the ids appended
                                                (`streams.AgentEpisode.prompt`)
            start them on a free sampler row  (`slots.SlotPool`: continuous batching)
            decode a chunk; each reply that ended is recorded in its sample's stream —
            the sampled ids and logprobs, never its text re-tokenised — and sent back as
            an OpenAI chat completion (tool calls parsed from it)
        the agent's return value is the reward of every sample of its episode

An agent that raises, or returns something that is neither a finite number nor a dict
`envs.outside_agent.agent_outcome` accepts, gets reward 0, is logged, and counts in
``agent/failures``; one past its deadline in ``agent/timeouts``.
Each reply's noise is keyed by (`turns.turn_seed` of the sample seed and the sample's
turn, the sample's trajectory id), as in the other rollouts.

A request's `max_tokens` and `stop` strings cut the reply after decoding (the tokens kept
are the ones the sampler drew, up to and including the one that completed the stop
string); its `temperature` and `top_p` do not change the sampling: the run's generation
settings are the behaviour policy the learner corrects for, so a request asking for others
is answered from them and counted (``agent/sampling_overridden``).
"""

from __future__ import annotations

import concurrent.futures
import functools
import logging
import queue
import threading
import time
from collections.abc import Sequence

import numpy as np

from jaxrl_agentic.data.trajectory import Trajectory
from jaxrl_agentic.envs.outside_agent import AgentOutcome, run_agent
from jaxrl_agentic.envs.python_env import PythonEnvFactory
from jaxrl_agentic.rollout.groups import EpisodeSpec
from jaxrl_agentic.rollout.turns import GenerationConfig, set_episode_metrics, turn_seed
from jaxrl_agentic.serving.protocol import (
    ChatRequest,
    RequestError,
    assistant_message,
    completion_body,
)
from jaxrl_agentic.serving.server import AgentServer, shared_server
from jaxrl_agentic.serving.slots import make_pool
from jaxrl_agentic.serving.streams import AgentEpisode, Formatters

_log = logging.getLogger(__name__)
# The gathering window (`_Rollout._gather`): at most this long, and at most GATHER_THINK_X times
# the agents' median time between a reply and their next request.
GATHER_MAX_S = 0.02
GATHER_THINK_X = 2.0
AGENT_COUNTS = ("requests", "rewritten_histories", "unappendable_messages",
                "sampling_overridden", "failures", "timeouts", "samples")


class AgentRolloutRunner:
    """Plays batches of `openai_agent` episodes with one sampler (module doc)."""

    def __init__(self, env_factory: PythonEnvFactory, sampler, tokenizer, *, tag: str,
                 max_turns: int, max_input_length: int, generation: GenerationConfig,
                 run_seed: int = 0, slots: int = 0, decode_chunk: int = 8,
                 server: AgentServer | None = None):
        need = max_input_length + generation.max_tokens_per_step + 1
        if sampler.max_total_len < need:
            raise ValueError(f"sampler max_total_len={sampler.max_total_len} < "
                             f"max_input_length + max_tokens_per_step + 1 = {need}")
        if int(slots) < 0 or int(decode_chunk) < 1:
            raise ValueError(f"slots must be >= 0 (0 = one per episode) and decode_chunk "
                             f">= 1, got {slots} and {decode_chunk}")
        self.env_factory, self.sampler, self.tag = env_factory, sampler, tag
        self.formatters = Formatters(tokenizer)
        self.tokenizer = tokenizer
        self.max_turns, self.max_input_length = int(max_turns), int(max_input_length)
        self.generation, self.run_seed = generation, int(run_seed)
        self.slots, self.decode_chunk = int(slots), int(decode_chunk)
        self._server = server
        self.stats = dict.fromkeys(("episodes", *AGENT_COUNTS), 0)

    @property
    def server(self) -> AgentServer:
        if self._server is None:
            self._server = shared_server()
        return self._server

    def run(self, episodes: Sequence[EpisodeSpec], *, sample_seed: int,
            traj_id_start: int = 0, params=None, greedy: bool | None = None,
            temperature: float | None = None) -> list[Trajectory]:
        """Plays `episodes` to the end (module doc); → every sample's trajectory, the
        episodes' first samples in episode order, then the later ones."""
        gen = self.generation.overridden(greedy, temperature)
        rollout = _Rollout(self, episodes, gen, sample_seed=sample_seed,
                           traj_id_start=traj_id_start, params=params)
        trajs = rollout.play()
        self.stats["episodes"] += len(episodes)
        return trajs

    def replay_frames(self, traj: Trajectory) -> list[np.ndarray]:
        """An outside agent has no picture."""
        return []


class _Rollout:
    """One `run`: its episodes, their agents' threads and the requests they send."""

    def __init__(self, runner: AgentRolloutRunner, specs: Sequence[EpisodeSpec],
                 gen: GenerationConfig, *, sample_seed: int, traj_id_start: int, params):
        self.runner, self.gen, self.sample_seed = runner, gen, sample_seed
        self.live = params if hasattr(params, "current") else None
        self.params = params
        self.specs = list(specs)
        self.episodes = [AgentEpisode(spec, traj_id_start + i, runner.tag, runner.formatters,
                                      max_input_length=runner.max_input_length,
                                      max_turns=runner.max_turns)
                         for i, spec in enumerate(self.specs)]
        self.envs = [runner.env_factory(spec, runner.run_seed) for spec in self.specs]
        self.inbox: queue.SimpleQueue = queue.SimpleQueue()
        # episode -> (how it ended: "ok" | "failed" | "timeout", the agent's outcome if ok)
        self.outcomes: dict[int, tuple[str, AgentOutcome | None]] = {}
        self.keys: list[str] = []
        self.deadlines: list[float | None] = []
        self.answered_at: dict[int, float] = {}  # episode -> when its last reply was sent
        self.think_s: list[float] = []  # reply → next request, the latest of each agent's

    # ---- the agents' side (their threads and the server's) ---------------------------------

    def _submit(self, episode: int, request: ChatRequest) -> concurrent.futures.Future:
        future: concurrent.futures.Future = concurrent.futures.Future()
        self.inbox.put(("request", episode, request, future))
        return future

    def _agent(self, episode: int, base_url: str, key: str) -> None:
        env = self.envs[episode]
        try:
            outcome = ("ok", run_agent(env.agent, base_url, key, env.task))
        except Exception as e:
            spec = self.specs[episode]
            _log.warning("openai_agent %r episode seed=%s member=%s: the agent failed "
                         "(%s: %s); reward 0 (agent/failures)", self.runner.tag, spec.seed,
                         spec.member, type(e).__name__, e)
            outcome = ("failed", None)
        self.inbox.put(("done", episode, outcome, None))

    # ---- the rollout's side ---------------------------------------------------------------

    def play(self) -> list[Trajectory]:
        runner, server = self.runner, self.runner.server
        n = len(self.specs)
        if not n:
            return []
        version, params = self.live.current() if self.live else (0, self.params)
        pool = make_pool(runner.sampler, self.gen, runner.slots or n,
                         max_input_length=runner.max_input_length, params=params,
                         decode_chunk=runner.decode_chunk)
        now = time.monotonic()
        for i, env in enumerate(self.envs):
            key = server.open_episode(functools.partial(self._submit, i))
            self.keys.append(key)
            self.deadlines.append(now + env.timeout_s if env.timeout_s > 0 else None)
            threading.Thread(target=self._agent, args=(i, server.base_url(key), key),
                             daemon=True, name=f"openai-agent-{i}").start()
        waiting: list[tuple] = []  # accepted prompts that wait for a sampler row
        in_flight: dict[tuple[int, int], tuple] = {}  # (episode, sample) -> its request
        try:
            while len(self.outcomes) < n or waiting or in_flight:
                idle = not (pool.busy or waiting)
                for message in self._messages(block=idle):
                    item = self._take(message)
                    if item is not None:
                        waiting.append(item)
                waiting += self._gather(waiting, in_flight)
                self._end_late_agents()
                still = []
                for item in waiting:
                    episode, sample = item[0], item[1]
                    key = (episode, self.episodes[episode].samples.index(sample))
                    if pool.prompt(key, sample.trajectory.tokens):
                        traj = sample.trajectory
                        pool.start(key, turn_seed(self.sample_seed, len(traj.turns)),
                                   traj.traj_id)
                        in_flight[key] = item
                    else:
                        still.append(item)
                waiting = still
                if pool.busy:
                    if self.live is not None:  # the newest policy from this chunk on
                        version, params = self.live.current()
                    done = pool.advance(params=params, version=version,
                                        poll=len(self.outcomes) < n)
                    for key, reply in done.items():
                        self._answer(pool, key, reply, in_flight.pop(key))
        finally:
            for key in self.keys:
                server.close_episode(key)
            self._refuse_the_rest()
        return self._trajectories()

    def _gather(self, waiting, in_flight) -> list[tuple]:
        """The requests of agents about to ask, waited for so that they start on the same
        decode chunk as the rest instead of one chunk later each (at a real model's chunk
        of ~0.5 s, agents that answer in a few milliseconds otherwise trickle in one chunk
        apart). An agent is about to ask when it has not ended and has no request waiting or
        decoding. The wait ends when every such agent has asked, and lasts at most
        `GATHER_MAX_S`, and at most `GATHER_THINK_X` × the agents' median time from a reply
        to their next request (none once that is over `GATHER_MAX_S`: slow agents are not
        waited for). Until one such time is known (the first turn) it is `GATHER_MAX_S`."""
        asking = {item[0] for item in waiting} | {key[0] for key in in_flight}
        about = [i for i in range(len(self.specs))
                 if i not in self.outcomes and i not in asking]
        if not about:
            return []
        window = GATHER_MAX_S
        if self.think_s:
            think = GATHER_THINK_X * float(np.median(self.think_s))
            window = think if think <= GATHER_MAX_S else 0.0
        deadline, out = time.monotonic() + window, []
        while about and (left := deadline - time.monotonic()) > 0:
            for message in self._messages(block=True, timeout=left):
                item = self._take(message)
                if item is not None:
                    out.append(item)
            asking |= {item[0] for item in out}
            about = [i for i in about if i not in self.outcomes and i not in asking]
        return out

    def _messages(self, block: bool, timeout: float = 0.05):
        """The inbox's messages now; when `block`, waits (≤ `timeout`) for the first."""
        out = []
        if block:
            try:
                out.append(self.inbox.get(timeout=timeout))
            except queue.Empty:
                return out
        while True:
            try:
                out.append(self.inbox.get_nowait())
            except queue.Empty:
                return out

    def _take(self, message):
        """A request → (episode, sample, request, future, context_len) to decode, or None
        (answered already: an error, or its episode has ended); an agent's end recorded."""
        kind, episode, payload, future = message
        if kind == "done":
            if episode not in self.outcomes:
                self.outcomes[episode] = payload
                self.runner.server.close_episode(self.keys[episode])
            return None
        if episode in self.outcomes:
            future.set_exception(RequestError(404, "this episode has ended",
                                              code="episode_not_found"))
            return None
        if episode in self.answered_at:  # how long the agent took to ask again
            self.think_s = [*self.think_s[-63:],
                            time.monotonic() - self.answered_at.pop(episode)]
        ep, gen = self.episodes[episode], self.gen
        if not gen.greedy and (
                (payload.temperature is not None and payload.temperature != gen.temperature)
                or (payload.top_p is not None and payload.top_p != gen.top_p)):
            ep.counts["sampling_overridden"] += 1
        try:
            sample, ids = ep.prompt(payload)
        except RequestError as e:
            future.set_exception(e)
            return None
        return episode, sample, payload, future, ep.accept(sample, payload, ids)

    def _end_late_agents(self) -> None:
        now = time.monotonic()
        for i, deadline in enumerate(self.deadlines):
            if deadline is not None and now > deadline and i not in self.outcomes:
                spec = self.specs[i]
                _log.warning("openai_agent %r episode seed=%s member=%s: the agent ran past "
                             "agent_timeout_s=%s; reward 0 (agent/timeouts)", self.runner.tag,
                             spec.seed, spec.member, self.envs[i].timeout_s)
                self.outcomes[i] = ("timeout", None)
                self.runner.server.close_episode(self.keys[i])

    def _answer(self, pool, key, reply, item) -> None:
        """Records a finished reply in its sample and sends the agent its completion."""
        episode, sample, request, future, context_len = item
        ep, decode = self.episodes[episode], self.runner.tokenizer.decode
        ids, stop_reason, text = cut_reply(list(reply.tokens), reply.stop_reason,
                                           request.max_tokens, request.stop, decode)
        if len(ids) < len(reply.tokens):
            pool.forget(key)  # its row holds the tokens cut off
        message = assistant_message(text, request.tool_choice,
                                    f"call_{self.keys[episode][:8]}_{ep.counts['requests']}")
        versions = reply.versions[:len(ids)] if self.live is not None else None
        ep.record_reply(sample, context_len=context_len, ids=ids,
                        logprobs=reply.logprobs[:len(ids)], stop_reason=stop_reason,
                        message=message, text=text, versions=versions)
        texts = [decode([t]) for t in ids] if request.logprobs else None
        self.answered_at[episode] = time.monotonic()
        future.set_result(completion_body(
            completion_id=f"chatcmpl-{self.keys[episode][:8]}-{ep.counts['requests']}",
            model=request.model, message=message, stop_reason=stop_reason,
            prompt_tokens=context_len, token_texts=texts,
            logprobs=[float(x) for x in reply.logprobs[:len(ids)]]))

    def _refuse_the_rest(self) -> None:
        for message in self._messages(block=False):
            if message[0] == "request":
                message[3].set_exception(RequestError(404, "this episode has ended",
                                                      code="episode_not_found"))

    def _trajectories(self) -> list[Trajectory]:
        first, later = [], []
        stats = self.runner.stats
        for i, ep in enumerate(self.episodes):
            how, outcome = self._checked_outcome(i)
            trajs = ep.finish(outcome or AgentOutcome(0.0), failed=how != "ok")
            if not trajs:  # the agent never called the endpoint: an episode without turns
                trajs = [Trajectory(traj_id=ep.traj_id, group_id=ep.spec.group_id,
                                    tag=ep.tag, seed=ep.spec.seed, tokens=[], turns=[],
                                    truncated=True, member=ep.spec.member)]
            set_episode_metrics(trajs)
            if outcome is not None and outcome.metrics:  # on the first sample, as the counts
                trajs[0].metrics.update({f"agent_metric/{k}": v
                                         for k, v in outcome.metrics.items()})
            counts = {**ep.counts, "failures": int(how == "failed"),
                      "timeouts": int(how == "timeout"), "samples": len(ep.samples)}
            for k, traj in enumerate(trajs):  # the episode's counts on its first sample
                traj.metrics.update({f"agent/{name}": float(counts.get(name, 0)) if k == 0
                                     else 0.0 for name in AGENT_COUNTS})
            for name in AGENT_COUNTS:
                stats[name] += counts.get(name, 0)
            first.append(trajs[0])
            later.extend(trajs[1:])
        return first + later


    def _checked_outcome(self, i: int) -> tuple[str, AgentOutcome | None]:
        """How episode `i` ended and its outcome; `turn_rewards` that do not count one per
        reply the episode got make it a failure (logged), not a guess at which is whose."""
        how, outcome = self.outcomes.get(i, ("timeout", None))
        if outcome is not None and outcome.turn_rewards is not None:
            replies = self.episodes[i].turns
            if len(outcome.turn_rewards) != replies:
                spec = self.specs[i]
                _log.warning("openai_agent %r episode seed=%s member=%s: the agent returned "
                             "%d turn_rewards for %d replies; reward 0 (agent/failures)",
                             self.runner.tag, spec.seed, spec.member,
                             len(outcome.turn_rewards), replies)
                return "failed", None
        return how, outcome


def cut_reply(ids: list[int], stop_reason: str, max_tokens: int | None,
              stop: Sequence[str], decode) -> tuple[list[int], str, str]:
    """(ids kept, stop reason, text shown) of a reply under a request's `max_tokens` and
    `stop` strings: at most `max_tokens` ids; with a stop string, the shortest prefix whose
    text holds one, shown up to it (OpenAI leaves the stop string out)."""
    if max_tokens is not None and len(ids) > max_tokens:
        ids, stop_reason = ids[:max_tokens], "length"
    text = decode(ids, skip_special_tokens=True)
    if stop and any(s in text for s in stop):
        for n in range(1, len(ids) + 1):
            head = decode(ids[:n], skip_special_tokens=True)
            found = [head.find(s) for s in stop if s in head]
            if found:
                return ids[:n], "stop", head[:min(found)]
    return ids, stop_reason, text


def agent_rollout_runner(factory: PythonEnvFactory, sampler, formatter, *, tag: str,
                         max_turns: int, max_input_length: int, generation: GenerationConfig,
                         run_seed: int = 0, batching: str = "continuous", slots: int = 0,
                         decode_chunk: int = 8) -> AgentRolloutRunner:
    """`AgentRolloutRunner` as `rollout.runner.make_runner` builds an environment's own
    runner (`envs.outside_agent.RUNNER`). Requests always decode with continuous batching
    (`batching` is the run's setting for other environments)."""
    del batching
    return AgentRolloutRunner(factory, sampler, formatter.tokenizer, tag=tag,
                              max_turns=max_turns, max_input_length=max_input_length,
                              generation=generation, run_seed=run_seed, slots=slots,
                              decode_chunk=decode_chunk)
