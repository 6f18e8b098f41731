"""Where the endpoint's replies are decoded: sampler rows shared by every agent's samples.

`SlotPool` (the JAX `Sampler`) is continuous batching over one session's rows
(`sampling.SlotDecoder`): the requests of many agents decode together, each started when it
arrives and returned when its reply ends, while the others keep decoding. A sample keeps its
row between requests, so its next prompt prefills only what was appended (prefix reuse);
when every row is taken, the least recently used row whose sample is not mid-reply is
given to the new one (that sample re-prefills its whole stream on its next request).

`SessionPool` serves any other `SamplerBackend` through its sessions (one per sample, one
`generate` per reply): the same streams and tokens, without batching across agents.

Both take a sample's whole stream (`prompt`) and append to their row only what it does
not hold yet; `forget` drops a sample's row (its reply was cut after decoding, so the row
holds tokens the stream does not).
"""

from __future__ import annotations

import collections
from collections.abc import Hashable

import numpy as np

from jaxrl_agentic.rollout.turns import GenerationConfig
from jaxrl_agentic.sampling import Sampler, SlotDecoder, SlotReply

POLL_S = 0.002  # how long `advance` waits for a chunk while agents may send requests


class SlotPool:
    """Continuous batching over `num_slots` rows of one sampler session (module doc)."""

    def __init__(self, sampler: Sampler, gen: GenerationConfig, num_slots: int, *,
                 max_input_length: int, params=None, decode_chunk: int = 8,
                 chunk_grid: str = "1.5x"):
        self.session = sampler.new_session(num_slots, sampler.max_total_len)
        self.decoder = SlotDecoder(self.session, max_new_tokens=gen.max_tokens_per_step,
                                   chunk=decode_chunk, temperature=gen.temperature,
                                   top_p=gen.top_p, top_k=gen.top_k, greedy=gen.greedy,
                                   stop_token_ids=gen.stop_token_ids, chunk_grid=chunk_grid)
        if sampler.precompile_slots:
            self.decoder.precompile(max_prompt=max_input_length, params=params)
        self.num_slots = num_slots
        self._slot_of: dict[Hashable, int] = {}
        self._key_of: dict[int, Hashable] = {}
        self._idle: collections.OrderedDict[Hashable, None] = collections.OrderedDict()
        self._free = list(range(num_slots))[::-1]
        self._to_start: list[tuple[Hashable, int, int]] = []
        self._live: set[Hashable] = set()

    @property
    def busy(self) -> bool:
        """Whether a reply is started or decoding."""
        return bool(self._live)

    def prompt(self, key: Hashable, stream: list[int]) -> bool:
        """Makes `key`'s row hold `stream`; False when no row can be had now."""
        slot = self._slot_of.get(key)
        if slot is None:
            if self._free:
                slot = self._free.pop()
            elif self._idle:
                old, _ = self._idle.popitem(last=False)  # least recently used
                slot = self._slot_of.pop(old)
            else:
                return False
            self.session.reset_row(slot)
            self._slot_of[key], self._key_of[slot] = slot, key
        self._idle.pop(key, None)
        held = self.session.length(slot)
        if held > len(stream):
            raise ValueError(f"sample {key!r}: its row holds {held} tokens, more than its "
                             f"stream's {len(stream)}")
        self.session.extend([slot], [stream[held:]])
        return True

    def start(self, key: Hashable, seed: int, row_id: int) -> None:
        """Starts `key`'s reply (after `prompt`); its noise is keyed by (seed, row_id)."""
        self._to_start.append((key, seed, row_id))
        self._live.add(key)

    def advance(self, *, params=None, version: int = 0,
                poll: bool = False) -> dict[Hashable, SlotReply]:
        """Starts what can start, runs a chunk on every block with live rows, and → the
        replies that ended (waits ≤ POLL_S for a chunk when `poll`)."""
        startable = [s for s in self._to_start if self.decoder.idle(self._slot_of[s[0]])]
        if startable:
            self._to_start = [s for s in self._to_start if s not in startable]
            self.decoder.start([self._slot_of[k] for k, _, _ in startable],
                               [seed for _, seed, _ in startable],
                               [row_id for _, _, row_id in startable])
        self.decoder.launch(params=params, version=version)
        done = {}
        if self.decoder.decoding:
            for slot, reply in self.decoder.collect(timeout=POLL_S if poll else None).items():
                key = self._key_of[slot]
                self._live.discard(key)
                self._idle[key] = None
                done[key] = reply
        return done

    def forget(self, key: Hashable) -> None:
        """Drops `key`'s row (module doc); its next `prompt` loads the whole stream."""
        slot = self._slot_of.pop(key, None)
        if slot is not None:
            del self._key_of[slot]
            self._idle.pop(key, None)
            self._free.append(slot)


class SessionPool:
    """Any `SamplerBackend`: one session per sample, one `generate` per reply."""

    def __init__(self, sampler, gen: GenerationConfig):
        self.sampler, self.gen = sampler, gen
        self._sessions: dict[Hashable, object] = {}
        self._held: dict[Hashable, int] = {}
        self._to_start: list[tuple[Hashable, int, int]] = []

    @property
    def busy(self) -> bool:
        return bool(self._to_start)

    def prompt(self, key: Hashable, stream: list[int]) -> bool:
        if key not in self._sessions:
            self._sessions[key], self._held[key] = self.sampler.new_session(1), 0
        self._sessions[key].extend([0], [stream[self._held[key]:]])
        self._held[key] = len(stream)
        return True

    def start(self, key: Hashable, seed: int, row_id: int) -> None:
        self._to_start.append((key, seed, row_id))

    def advance(self, *, params=None, version: int = 0,
                poll: bool = False) -> dict[Hashable, SlotReply]:
        del poll
        done, gen = {}, self.gen
        for key, seed, row_id in self._to_start:
            out = self._sessions[key].generate(
                [0], max_new_tokens=gen.max_tokens_per_step, temperature=gen.temperature,
                top_p=gen.top_p, top_k=gen.top_k, greedy=gen.greedy, seed=seed,
                stop_token_ids=list(gen.stop_token_ids) or None, params=params,
                row_seeds=[row_id])
            tokens = list(out.tokens[0])
            self._held[key] += len(tokens)
            done[key] = SlotReply(tokens, np.asarray(out.logprobs[0], np.float32),
                                  out.stop_reasons[0],
                                  np.full(len(tokens), version, np.int32))
        self._to_start = []
        return done

    def forget(self, key: Hashable) -> None:
        self._sessions.pop(key, None)
        self._held.pop(key, None)


def make_pool(sampler, gen: GenerationConfig, num_slots: int, **slot_options):
    """`SlotPool` for the JAX sampler, `SessionPool` for any other backend."""
    if isinstance(sampler, Sampler):
        return SlotPool(sampler, gen, num_slots, **slot_options)
    return SessionPool(sampler, gen)
