"""Rollouts at environment granularity: continuous batching over a pool of sampler slots.

In turn lockstep (`loop.play_turns`) every running episode generates in one sampler call
per turn: the call lasts as long as the longest reply, the environments wait for it, and
the next turn waits for the slowest environment. Here each episode moves on its own:

    while episodes remain:
        start the slots whose episode has a new prompt   (prefill only what is new)
        decode every live slot for ≤ `decode_chunk` tokens
        hand each reply that ended to its environment    (Python envs: on their pool)
        take the environment answers that are back       (block only if nothing decodes)
            → record the turn; the episode's next prompt goes into the same slot, or,
              when it ended, the slot takes the next episode of the step's plan

When the sampler splits the slots into row blocks (one thread each, `Sampler.decode_threads`),
the blocks do not wait for each other: a block's turn (the prefill of its new prompts, then a
chunk) runs on its thread, and the loop handles each block as soon as its chunk is done
(`SlotDecoder.launch` / `collect`). In lockstep blocks, every chunk lasted as long as the
busiest block's, and prefills ran on the loop's thread while no block decoded
(bench_rollout: docs/benchmarks.md, "Continuous batching").

A slot is a row of one sampler session (its KV cache); `slots` of them (0: one per
episode) serve all episodes in plan order. Prefix reuse, the length check on the current
prompt, the EOS a reply is closed with and exact logprobs are those of lockstep, and so are
the tokens: a reply's noise is keyed by (sample seed, turn, episode id) only
(`turns.turn_seed`, `slot_decoder`), so for the same seeds both schedules produce the same
trajectories token for token, whatever the slot count or chunk size.

In-flight weight updates: `params` may be a live policy (`LivePolicy`: `current()` →
(version, params), e.g. the `RolloutProducer` the learner publishes to). The loop then reads
it before each round of starts and chunks, so a learner update reaches every live reply at
its next chunk boundary, without a pause and without copying weights, and each token
records the version that sampled it (`Turn.versions`); its logprob is that version's.

The slots' KV cache is allocated for `max_total_len` at the start, as a serving engine's
slot pool is: attention reads only the slots in use (`CacheExtent`), so a fixed cache
costs no more per step than a growing one and its programs are compiled once, up front
(`SlotDecoder.precompile`), not whenever a stream first reaches a new length.
"""

from __future__ import annotations

import collections
from typing import Any, Protocol

from jaxrl_agentic.rollout.segments import EpisodeSegments
from jaxrl_agentic.rollout.turns import GenerationConfig, close_reply, record_turn, turn_seed
from jaxrl_agentic.sampling import Sampler, SlotDecoder

# How long the loop waits for a chunk before it looks for environment answers again, while a
# block has no live row (all its episodes wait for their environment).
POLL_S = 0.002


class LivePolicy(Protocol):
    def current(self) -> tuple[int, Any]:
        """(version, params) of the newest policy: what the next chunk decodes with."""


def play_continuous(envs, segments: EpisodeSegments, pending: dict[int, list[int]],
                    sampler: Sampler, formatter, gen: GenerationConfig, *, sample_seed: int,
                    max_turns: int, max_input_length: int, params, slots: int = 0,
                    decode_chunk: int = 8, chunk_grid: str = "1.5x") -> None:
    """Plays every episode with a first prompt in `pending` to its end (see module doc);
    `params`: the policy's params, or a `LivePolicy` for in-flight updates; `chunk_grid`:
    the grid of a chunk's rows and attention read lengths (`SlotDecoder`). An episode whose
    history is rewritten (`segments.py`) keeps its slot: the row is emptied and prefilled
    with the new segment's stream, as when a slot takes a new episode."""
    trajs = segments.trajs  # each episode's current segment (a rewrite replaces it)
    live = params if hasattr(params, "current") else None
    version, params = live.current() if live is not None else (0, params)
    waiting = collections.deque(sorted(pending))  # episodes not started, in plan order
    num_slots = min(len(waiting), slots or len(waiting))
    if not num_slots:
        return
    session = sampler.new_session(num_slots, sampler.max_total_len)
    decoder = SlotDecoder(session, max_new_tokens=gen.max_tokens_per_step, chunk=decode_chunk,
                          temperature=gen.temperature, top_p=gen.top_p, top_k=gen.top_k,
                          greedy=gen.greedy, stop_token_ids=gen.stop_token_ids,
                          chunk_grid=chunk_grid)
    # Once per sampler: no prompt or stream length compiles anything later.
    if sampler.precompile_slots:
        decoder.precompile(max_prompt=max_input_length, params=params)
    free = list(range(num_slots))[::-1]
    episode_of: dict[int, int] = {}  # slot -> its episode
    slot_of: dict[int, int] = {}  # episode -> its slot
    ready: list[int] = []  # slots whose episode has a prompt in `pending`
    prompted: list[int] = []  # slots whose prompt is in their stream, waiting to start
    replies = {}  # episode -> its reply, while its environment steps
    in_env = 0

    def release(slot: int) -> None:
        del slot_of[episode_of.pop(slot)]
        free.append(slot)

    while True:
        # 1. free slots take the next episodes; slots with a new prompt start a reply once
        #    their row block is not decoding (a chunk in flight owns its block's cache)
        while ready or (free and waiting):
            while free and waiting:
                slot, episode = free.pop(), waiting.popleft()
                session.reset_row(slot)
                episode_of[slot], slot_of[episode] = episode, slot
                ready.append(slot)
            for slot in ready:
                episode = episode_of[slot]
                if segments.append_prompt(episode, session, slot, pending.pop(episode),
                                          max_input_length):
                    prompted.append(slot)
                else:
                    release(slot)
            ready = []
        starting = [slot for slot in prompted if decoder.idle(slot)]
        if starting:
            prompted = [slot for slot in prompted if slot not in starting]
            episodes = [episode_of[slot] for slot in starting]
            decoder.start(starting,
                          [turn_seed(sample_seed, segments.turns_played(e)) for e in episodes],
                          [segments.row_seed(e) for e in episodes])
        if live is not None:  # the newest policy, from this round's chunks on
            version, params = live.current()
        # 2. a chunk on every block with live rows; the replies that ended in the chunks
        #    that are done go to their environments. A block whose rows all wait for their
        #    environment would idle until the others' chunks end: then wait for those only
        #    briefly, and look for answers in between.
        decoder.launch(params=params, version=version)
        if decoder.decoding:
            poll = in_env and not decoder.all_decoding
            for slot, out in decoder.collect(timeout=POLL_S if poll else None).items():
                episode = episode_of[slot]
                reply = close_reply(session, slot, trajs[episode], out.tokens, out.logprobs,
                                    out.stop_reason, formatter,
                                    out.versions if live is not None else None)
                replies[episode] = reply
                segments.replied(episode, reply)
                envs.submit(episode, reply.reply, segments.turns_played(episode))
                in_env += 1
        elif not in_env:
            break  # nothing decodes, nothing steps, nothing waits: every episode ended
        # 3. the environments' answers: wait for one only when nothing decodes
        busy = decoder.decoding or prompted or decoder.live_rows
        for episode, outcome in envs.collect("none" if busy else "any"):
            in_env -= 1
            if record_turn(trajs[episode], replies.pop(episode), outcome,
                           max_steps=envs.max_steps(episode), max_turns=max_turns,
                           played_before=segments.turns_before[episode]):
                pending[episode] = outcome.next_prompt()
                segments.answered(episode, outcome)
                ready.append(slot_of[episode])
            else:
                release(slot_of[episode])
