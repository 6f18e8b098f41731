"""Sessions: batches of token streams that share a KV cache and grow turn by turn.

Multi-turn use keeps one `Session` per batch of trajectories. Each row holds its whole token
stream on the host and remembers how much of it is already in the cache; `extend(rows, ids)`
appends tokens, and the next `generate` prefills only the part that is not cached yet. Turn
t+1 therefore costs prefill of (observation + the last sampled token), never the history:
total prefill work per trajectory is linear in its final length.

A session's cache is static within a call but sized by the longest stream, not by
`max_total_len`: it starts at `min_cache_bucket` slots and doubles (zero-padded, at most
`max_total_len`) when a call needs more, so attention over a short stream costs what its
length costs. Prefill reads only the slots below its rows' new ends (`key_len`, a power of
two), not the whole reserved cache.

On one CPU device a session of many rows is a `ShardedSession`: contiguous row blocks, each
with its own cache, generated side by side on the sampler's thread pool (one block per
core), because one decode program keeps about one core busy. Rows keep their seed ids, so
the tokens are those of a single session.

A session runs the programs of the `Sampler` that made it (`Sampler.new_session`:
`prefill_program`, `decode_program`) and reads that sampler's settings.
"""

from __future__ import annotations

import bisect
from collections.abc import Sequence

import jax
import jax.numpy as jnp
import numpy as np

from jaxrl_agentic.models.transformer import KVCache
from jaxrl_agentic.runtime import timing
from jaxrl_agentic.runtime.parallel import kv_cache_sharding, rows_sharding
from jaxrl_agentic.sampling.buckets import (
    compact_length,
    compact_rows,
    extent_index,
    next_power_of_two,
)
from jaxrl_agentic.sampling.draws import REASON_LENGTH, STOP_REASONS, stop_ids_array
from jaxrl_agentic.sampling.protocol import GenerationResult


class Session:
    """A batch of token streams sharing one KV cache; rows are extended turn by turn."""

    def __init__(self, sampler, num_rows: int, reserve: int = 0):
        self.sampler = sampler
        self.num_rows = num_rows
        self.capacity = next_power_of_two(num_rows)
        self.streams: list[list[int]] = [[] for _ in range(num_rows)]
        self.cached = np.zeros(num_rows, np.int64)  # tokens of each stream already in cache
        self.cache = self._placed(sampler.empty_cache(self.capacity, reserve))

    def _placed(self, cache: KVCache) -> KVCache:
        if self.sampler.mesh is None:
            return cache
        return jax.device_put(cache, kv_cache_sharding(self.sampler.mesh, cache.k[0].shape))

    def row_input(self, array: np.ndarray) -> jax.Array:
        """A per-row input, placed like the cache's rows."""
        if self.sampler.mesh is None:
            return jax.device_put(array)  # jnp.asarray would compile a copy per shape
        return jax.device_put(array, rows_sharding(self.sampler.mesh, self.capacity))

    def length(self, row: int) -> int:
        return len(self.streams[row])

    def reset_row(self, row: int) -> None:
        """Empties a row for a new stream (a slot taking its next episode). The cache keeps
        the old keys, but a query at position p reads only slots ≤ p, and the new stream
        rewrites those before it reads them (prefill from position 0)."""
        self.streams[row] = []
        self.cached[row] = 0

    def reserve(self, end: int) -> None:
        """Grows the cache (if needed) to hold slots below `end` (capped at max_total_len)."""
        max_len = self.sampler.cache_bucket(end)
        if max_len > self.cache.max_len:
            self.cache = self._placed(self.sampler.grown_cache(self.cache, max_len))

    def extend(self, rows: Sequence[int], new_ids: Sequence[Sequence[int]]) -> None:
        """Appends tokens to rows' streams (prefilled lazily by the next `generate`)."""
        for row, ids in zip(rows, new_ids, strict=True):
            if len(self.streams[row]) + len(ids) > self.sampler.max_total_len:
                raise ValueError(
                    f"row {row}: {len(self.streams[row]) + len(ids)} tokens exceed "
                    f"max_total_len={self.sampler.max_total_len}"
                )
            self.streams[row].extend(int(t) for t in ids)

    @timing.spanned("rollout/prefill")
    def prefill(self, rows: Sequence[int], params, compact: bool = False) -> jax.Array:
        """Feeds each row's uncached tail; returns the logits at each row's last token
        ([capacity, V]; other rows' entries are not meaningful).

        By default the program runs every row of the session (turn lockstep prefills most of
        them at once). `compact` runs only `rows`, padded to a power-of-two fraction of the
        capacity (`compact_rows`): continuous batching starts a few slots at a time, and a
        full-width prefill for each of them cost it more than its decoding (bench_rollout).

        With `sampler.share_prompt_prefill`, new streams (nothing cached) with the same
        tokens, such as a GRPO group's members at their first turn, are prefilled once: the
        others get that row's cache slots and logits copied (`copy_rows`), and the prefill
        runs compact over the distinct streams (`prefill_shared_tokens` counts what it did
        not compute).
        """
        tails = {}
        for row in rows:
            if not self.streams[row]:
                raise ValueError(f"row {row}: cannot generate from an empty stream")
            if self.cached[row] == len(self.streams[row]):
                self.cached[row] -= 1  # re-feed the last token to get its logits
            tails[row] = self.streams[row][self.cached[row] :]
        copies = self._same_new_streams(tails) if self.sampler.share_prompt_prefill else {}
        for row in copies:
            del tails[row]
        if copies:
            logits = self._prefill_tails(tails, params, compact=True)
            self.cache, logits = self.sampler.copy_rows(self.cache, logits, copies)
            for row, source in copies.items():
                self.cached[row] = self.cached[source]
            self.sampler.count(prefill_shared_tokens=sum(int(self.cached[r]) for r in copies))
            return timing.ready(logits)
        return timing.ready(self._prefill_tails(tails, params, compact))

    def _same_new_streams(self, tails: dict[int, list[int]]) -> dict[int, int]:
        """{row: the earlier row it copies}: streams with nothing cached and equal tokens."""
        first: dict[tuple[int, ...], int] = {}
        copies = {}
        for row, tail in tails.items():
            if self.cached[row] == 0:
                source = first.setdefault(tuple(tail), row)
                if source != row:
                    copies[row] = source
        return copies

    def _prefill_tails(self, tails: dict[int, list[int]], params, compact: bool) -> jax.Array:
        """Runs `tails` (row → its uncached tokens) through the prefill program (`prefill`)."""
        longest = max(len(t) for t in tails.values())
        t_bucket = (compact_length if compact else next_power_of_two)(
            longest, self.sampler.min_prefill_bucket)
        batch = compact_rows(len(tails), self.capacity) if compact else self.capacity
        tokens = np.zeros((batch, t_bucket), np.int32)
        valid = np.zeros((batch, t_bucket), bool)
        positions = np.zeros((batch, t_bucket), np.int32)
        # Input row i runs cache row index[i]; padding rows name no row (never written).
        index = np.full(batch, self.capacity, np.int32) if compact else None
        for i, (row, tail) in enumerate(tails.items()):
            n, at = len(tail), i if compact else row
            tokens[at, :n] = tail
            valid[at, :n] = True
            positions[at] = self.cached[row] + np.arange(t_bucket)
            if compact:
                index[i] = row
            self.cached[row] += n
        self.sampler.count(prefill_tokens=sum(len(t) for t in tails.values()), prefill_calls=1)
        end = max(int(self.cached[row]) for row in tails)
        self.reserve(end)
        if compact:
            # The read length is chosen at run time (one program for every stream length of
            # a slot pool's fixed cache; see `key_extents`).
            extents = self.sampler.key_extents(self.cache.max_len)
            self.cache, logits = self.sampler.prefill_program(
                params, self.cache, *jax.device_put((tokens, positions, valid, index)),
                extent_index(extents, end),
                extents=extents)
        else:
            self.cache, logits = self.sampler.prefill_program(
                params, self.cache, self.row_input(tokens), self.row_input(positions),
                self.row_input(valid), None, key_len=min(
                    self.cache.max_len,
                    next_power_of_two(end, self.sampler.min_prefill_bucket)))
        return logits

    @timing.spanned("rollout/decode")
    def generate(
        self,
        rows: Sequence[int],
        *,
        max_new_tokens: int,
        temperature: float = 1.0,
        top_p: float = 1.0,
        top_k: int = 0,
        greedy: bool = False,
        seed: int = 0,
        stop_token_ids: Sequence[int] | None = None,
        params=None,
        row_seeds: Sequence[int] | None = None,
    ) -> GenerationResult:
        """Continues each of `rows` from the end of its stream; appends what it generates.

        Row ``r`` draws its noise from ``fold_in(PRNGKey(seed), row_seeds[r])`` (default: the
        row index): give each stream a global id (e.g. its episode id) and its tokens no
        longer depend on the batch it was generated in or the process that ran it.
        """
        rows = list(rows)
        stops = stop_ids_array(temperature, top_p, stop_token_ids)
        params = self.sampler.params if params is None else params
        logits = self.prefill(rows, params)

        active = np.zeros(self.capacity, bool)
        active[rows] = True
        budget = np.zeros(self.capacity, np.int32)
        for row in rows:  # a row never writes past the cache
            budget[row] = min(max_new_tokens, self.sampler.max_total_len - len(self.streams[row]))
        positions = np.array([len(s) for s in self.streams] + [0] * (self.capacity - self.num_rows))
        row_ids = np.arange(self.capacity, dtype=np.int32)
        if row_seeds is not None:
            if len(row_seeds) != self.num_rows:
                raise ValueError(f"row_seeds has {len(row_seeds)} entries for "
                                 f"{self.num_rows} rows")
            row_ids[: self.num_rows] = row_seeds
        max_new_bucket = next_power_of_two(max(1, int(budget.max())))
        # Fed tokens land below len(stream) + budget - 1 (the last one is not fed).
        self.reserve(max(len(self.streams[r]) + int(budget[r]) for r in rows))
        self.cache, out_tokens, out_logprobs, n_gen, reasons, steps = self.sampler.decode_program(
            params,
            self.cache,
            logits,
            self.row_input(positions.astype(np.int32)),
            self.row_input(active & (budget > 0)),
            self.row_input(budget),
            jax.random.PRNGKey(seed),
            self.row_input(row_ids),
            jnp.float32(temperature),
            jnp.int32(top_k),
            jnp.float32(top_p),
            jnp.bool_(greedy),
            jnp.asarray(stops),
            max_new_bucket=max_new_bucket,
        )
        out_tokens, out_logprobs, n_gen, reasons = jax.device_get(
            (out_tokens, out_logprobs, n_gen, reasons)
        )
        self.sampler.count(decode_steps=int(steps), decode_row_steps=int(steps) * self.capacity)
        result = GenerationResult([], [], [])
        for row in rows:
            n = int(n_gen[row])
            ids = out_tokens[row, :n].tolist()
            result.tokens.append(ids)
            result.logprobs.append(np.asarray(out_logprobs[row, :n], np.float32))
            reason = max(int(reasons[row]), REASON_LENGTH * (n == 0))
            result.stop_reasons.append(STOP_REASONS[reason])
            # Every generated token but the last was fed back, so it is cached already.
            self.cached[row] += max(0, n - 1)
            self.streams[row].extend(ids)
        return result


class ShardedSession:
    """A `Session` split into contiguous row blocks, each a `Session` with its own cache,
    whose `generate` calls run side by side on the sampler's thread pool.

    Why: on a CPU one decode program keeps about one core busy. Its per-step ops are small,
    their time grows with the rows and they barely spread over cores (batch 32 of the tiny
    model decodes as fast on one core as on two), while independent programs do run in
    parallel (docs/benchmarks.md, "Sampler").
    Row r keeps seed id r (or ``row_seeds[r]``) in whichever block it lies, so the tokens
    drawn are those a single `Session` would draw. Same interface as `Session`.
    """

    def __init__(self, sampler, num_rows: int, reserve: int, blocks: int):
        self.sampler = sampler
        self.num_rows = num_rows
        self.starts = [num_rows * i // blocks for i in range(blocks + 1)]
        self.blocks = [Session(sampler, hi - lo, reserve)
                       for lo, hi in zip(self.starts[:-1], self.starts[1:], strict=True)]

    def locate(self, row: int) -> tuple[int, int]:
        block = bisect.bisect_right(self.starts, row) - 1
        if not 0 <= row < self.num_rows:
            raise IndexError(f"row {row} is not in this session of {self.num_rows} rows")
        return block, row - self.starts[block]

    @property
    def streams(self) -> list[list[int]]:
        return [stream for block in self.blocks for stream in block.streams]

    def length(self, row: int) -> int:
        block, local = self.locate(row)
        return self.blocks[block].length(local)

    def reset_row(self, row: int) -> None:
        block, local = self.locate(row)
        self.blocks[block].reset_row(local)

    def reserve(self, end: int) -> None:
        for block in self.blocks:
            block.reserve(end)

    def extend(self, rows: Sequence[int], new_ids: Sequence[Sequence[int]]) -> None:
        for row, ids in zip(rows, new_ids, strict=True):
            block, local = self.locate(row)
            self.blocks[block].extend([local], [ids])

    def generate(self, rows: Sequence[int], *, row_seeds: Sequence[int] | None = None,
                 **kwargs) -> GenerationResult:
        """`Session.generate` (same arguments) with each block's rows generated in parallel."""
        rows = list(rows)
        if row_seeds is None:
            row_seeds = range(self.num_rows)
        elif len(row_seeds) != self.num_rows:
            raise ValueError(f"row_seeds has {len(row_seeds)} entries for {self.num_rows} rows")
        where = [self.locate(row) for row in rows]
        for row, (block, local) in zip(rows, where, strict=True):
            if not self.blocks[block].length(local):  # said here with the session's row id
                raise ValueError(f"row {row}: cannot generate from an empty stream")
        jobs = []  # (block, its local rows) for the blocks that have rows to generate
        for b in range(len(self.blocks)):
            local = [loc for blk, loc in where if blk == b]
            if local:
                jobs.append((b, local))

        def run(job):
            b, local = job
            lo, hi = self.starts[b], self.starts[b + 1]
            return self.blocks[b].generate(local, row_seeds=list(row_seeds[lo:hi]), **kwargs)

        by_row = {}
        for (b, local), out in zip(jobs, self.sampler.run_side_by_side(run, jobs), strict=True):
            for loc, tokens, logprobs, reason in zip(local, out.tokens, out.logprobs,
                                                     out.stop_reasons, strict=True):
                by_row[self.starts[b] + loc] = (tokens, logprobs, reason)
        result = GenerationResult([], [], [])
        for row in rows:
            tokens, logprobs, reason = by_row[row]
            result.tokens.append(tokens)
            result.logprobs.append(logprobs)
            result.stop_reasons.append(reason)
        return result
