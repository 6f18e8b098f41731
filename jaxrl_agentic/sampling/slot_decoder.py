"""Continuous batching in the sampler: a session's rows are slots, decoded in chunks.

    decoder = SlotDecoder(session, max_new_tokens=64, chunk=8, temperature=1.0)
    decoder.start(rows, seeds, row_ids)        # their new prompts, prefilled by the next chunk
    while decoder.live_rows:
        for row, reply in decoder.decode(params=params).items():  # ≤ `chunk` steps
            ...   # the row's reply is done: step its environment, later `start` it again

`Session.generate` runs one reply per row and returns when the slowest row is done. Here a
row's reply lives across calls: `decode` advances every live row by at most `chunk` tokens
and returns the replies that ended, while the others keep their place (last drawn token,
position, count, budget) for the next call. A row whose reply ended can be extended and
`start`ed again — or `reset_row`ed for a new episode — while the others are mid-reply.

Same tokens as `Session.generate`. Reply token j of a row is drawn from the logits after
the same context with the uniforms ``row_uniforms(fold_in(PRNGKey(seed), row_id))[j]``
that `generate(rows, seed=seed, row_seeds=…)` uses, so a reply does not depend on the
chunking or on which rows shared its steps; logprobs agree to float rounding.

The first token of a reply is drawn from the prefill's logits (`fresh` rows, at the
chunk's first step), every later one after feeding its predecessor; a reply's last token
is not fed back (the next prefill feeds it), as in `generate`. With a `ShardedSession`
each row block has its own decoder state and its chunks run side by side on the sampler's
pool.

A chunk ends after `chunk` steps or when all its rows have, not as soon as one reply ends
or an environment answers: ending it early (a host callback each step, then a new chunk)
made bench_rollout's continuous rollout 0.72× as fast on a 2-core AMD EPYC (2026-11-29),
since a chunk's host round trip costs about one decode step of the tiny model.

`decode` waits for every block. `launch` and `collect` let blocks run on their own: `launch`
starts a chunk on each block that has live rows and is not decoding already, `collect`
returns the replies of the chunks that are done, so a block whose rows ended can hand them
to their environments and be `start`ed again (only rows of a block that is not decoding
can be: its chunk owns its cache) while the other blocks keep decoding.

The params are an argument of each chunk, not of the decoder: a caller may pass newer ones
from one chunk to the next (in-flight weight updates, `rollout/continuous.py`) without
pausing a reply. A chunk's prefill and its tokens all use the chunk's params, and each
token records the `version` its chunk was given (`SlotReply.versions`), so a reply that
spans several policies says exactly which sampled which token (and its logprob is that
policy's). The KV cache of the earlier context stays as the older params wrote it.

Cost follows the live rows, not the pool: a chunk runs only the live rows' width bucket
of its block (`chunk_width`: 1, 2, 3, 4, 6, 8, 12, 16, 24, …; on a CPU a step costs in
proportion to its rows, and most slots wait for their environment), a start prefills only
the rows being started, and attention reads only the cache slots the rows can reach,
chosen at run time among a few extents (`CacheExtent`; a chunk's on the same 1.5× grid:
with a small model, attention over the cache is most of a decode step's cost). Every
shape is therefore from a fixed grid — chunk widths, prefill rows × tail lengths — which
`precompile` compiles once per sampler: a run compiles nothing after its first rollout
whatever its prompt and reply lengths. `chunk_grid="pow2"` rounds a chunk's rows and read
lengths up to powers of two instead (fewer programs and branches, up to twice the work).
"""

from __future__ import annotations

import concurrent.futures
import dataclasses
import functools
from collections.abc import Sequence

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from jaxrl_agentic.runtime import timing
from jaxrl_agentic.sampling.buckets import (
    check_grid,
    chunk_width,
    compact_length,
    compact_rows,
    extent_index,
    next_power_of_two,
)
from jaxrl_agentic.sampling.draws import (
    REASON_LENGTH,
    STOP_REASONS,
    draw_tokens,
    output_weight,
    row_uniforms,
    stop_ids_array,
)
from jaxrl_agentic.sampling.sessions import Session, ShardedSession


@dataclasses.dataclass
class SlotReply:
    """A finished reply of one slot."""

    tokens: list[int]
    logprobs: np.ndarray
    stop_reason: str  # "eos" | "stop" | "length"
    versions: np.ndarray | None = None  # [len(tokens)] int32: the policy version of each


class _BlockState:
    """Host copy of one row block's per-row decode state (between chunks)."""

    def __init__(self, session: Session):
        rows = session.capacity
        self.session = session
        self.token = np.zeros(rows, np.int32)  # last drawn token (not fed yet)
        self.pos = np.zeros(rows, np.int32)  # where that token goes in the cache
        self.live = np.zeros(rows, bool)  # mid-reply
        self.fresh = np.zeros(rows, bool)  # started: first token comes from the prefill
        self.n_gen = np.zeros(rows, np.int32)
        self.budget = np.zeros(rows, np.int32)
        self.base_keys = np.zeros((rows, 2), np.uint32)
        self.row_ids = np.zeros(rows, np.int32)
        self.logits = None  # the last prefill's logits [rows, V] (fresh rows read theirs)
        self.to_prefill: list[int] = []  # rows `start`ed, their prompts not prefilled yet
        self.tokens: dict[int, list[int]] = {}
        self.logprobs: dict[int, list[np.ndarray]] = {}
        self.versions: dict[int, list[np.ndarray]] = {}


class SlotDecoder:
    """Chunked decoding over the rows of a `Session` or `ShardedSession` (see module doc)."""

    def __init__(self, session: Session | ShardedSession, *, max_new_tokens: int,
                 chunk: int = 8, temperature: float = 1.0, top_p: float = 1.0, top_k: int = 0,
                 greedy: bool = False, stop_token_ids: Sequence[int] | None = None,
                 chunk_grid: str = "1.5x"):
        stops = stop_ids_array(temperature, top_p, stop_token_ids)
        if chunk < 1 or max_new_tokens < 1:
            raise ValueError(f"chunk ({chunk}) and max_new_tokens ({max_new_tokens}) must "
                             f"be ≥ 1")
        self.sampler = session.sampler
        self.max_new_tokens = int(max_new_tokens)
        self.chunk = int(chunk)
        # The grid of a chunk's rows and read lengths ("pow2": both powers of two; a bad
        # name fails here, not at the first chunk).
        check_grid(chunk_grid)
        self.chunk_grid = chunk_grid
        self.max_new_bucket = next_power_of_two(self.max_new_tokens)
        self._sampling = (jnp.float32(temperature), jnp.int32(top_k), jnp.float32(top_p),
                          jnp.bool_(greedy), jnp.asarray(stops))
        self._session = session
        if isinstance(session, ShardedSession):
            self._starts = session.starts
            self._blocks = [_BlockState(block) for block in session.blocks]
        else:
            self._starts = [0, session.num_rows]
            self._blocks = [_BlockState(session)]
        self._program = self.sampler.program("decode_chunk", _chunk_program)
        self._inflight: dict[int, concurrent.futures.Future] = {}  # block -> its chunk

    def _locate(self, row: int) -> tuple[_BlockState, int]:
        if isinstance(self._session, ShardedSession):
            block, local = self._session.locate(row)
            return self._blocks[block], local
        if not 0 <= row < self._session.num_rows:
            raise IndexError(f"row {row} is not a slot of this decoder")
        return self._blocks[0], row

    @property
    def live_rows(self) -> list[int]:
        return [lo + int(r) for lo, block in zip(self._starts, self._blocks, strict=False)
                for r in np.flatnonzero(block.live)]

    @property
    def decoding(self) -> bool:
        """Whether a chunk `launch`ed on some block has not been `collect`ed yet."""
        return bool(self._inflight)

    def idle(self, row: int) -> bool:
        """Whether `row`'s block has no chunk in flight (so `row` may be `start`ed)."""
        return self._index(row) not in self._inflight

    @property
    def all_decoding(self) -> bool:
        """Whether every block has a chunk in flight."""
        return len(self._inflight) == len(self._blocks)

    def launch(self, *, params=None, version: int = 0) -> None:
        """Starts a chunk (≤ `chunk` tokens, after the prefill of the rows `start`ed since the
        last) on every block with live rows that has none in flight: on the sampler's pool
        when there are several blocks, at once when one. Its tokens record `version`."""
        params = self.sampler.params if params is None else params
        for index, block in enumerate(self._blocks):
            if index in self._inflight or not (block.live.any() or block.to_prefill):
                continue
            if len(self._blocks) > 1:
                self._inflight[index] = self.sampler.submit(self._work, params, block, version)
            else:  # nothing to run beside it: no thread hop
                done = concurrent.futures.Future()
                done.set_result(self._work(params, block, version))
                self._inflight[index] = done

    def collect(self, *, timeout: float | None = None) -> dict[int, SlotReply]:
        """{row: reply} of the rows whose reply ended in the chunks that are done; waits for
        the first chunk to end (at most `timeout` seconds; None: no limit) if none has."""
        if not self._inflight:
            return {}
        concurrent.futures.wait(list(self._inflight.values()), timeout=timeout,
                                return_when=concurrent.futures.FIRST_COMPLETED)
        finished: dict[int, SlotReply] = {}
        for index, future in list(self._inflight.items()):
            if future.done():
                del self._inflight[index]
                lo = self._starts[index]
                finished.update({lo + r: reply for r, reply in future.result().items()})
        return finished

    def _index(self, row: int) -> int:
        block, _ = self._locate(row)
        return self._blocks.index(block)

    def start(self, rows: Sequence[int], seeds: Sequence[int], row_ids: Sequence[int]) -> None:
        """Starts a reply in each of `rows` (not live, of blocks not decoding) from the end
        of its stream: what is not cached yet is prefilled by the next `launch` / `decode`,
        on the block's thread before its chunk and with its params. Row r draws its noise
        from ``fold_in(PRNGKey(seeds[r]), row_ids[r])``, as ``Session.generate(seed=…,
        row_seeds=…)`` does."""
        keys = {seed: np.asarray(jax.random.PRNGKey(seed)) for seed in set(seeds)}
        for row, seed, row_id in zip(rows, seeds, row_ids, strict=True):
            block, r = self._locate(row)
            if not self.idle(row):  # its chunk may be writing the block's state
                raise ValueError(f"row {row}'s block is decoding (collect its chunk first)")
            if block.live[r]:
                raise ValueError(f"row {row} is mid-reply")
            block.base_keys[r], block.row_ids[r] = keys[seed], row_id
            length = len(block.session.streams[r])
            budget = min(self.max_new_tokens, self.sampler.max_total_len - length)
            block.pos[r], block.budget[r], block.n_gen[r] = length, budget, 0
            block.live[r] = block.fresh[r] = budget > 0
            block.tokens[r], block.logprobs[r], block.versions[r] = [], [], []
            # The prefill runs with the block's next chunk, on the block's own thread.
            block.to_prefill.append(r)

    def _prefill(self, params, block: _BlockState) -> None:
        """Prefills the prompts of the rows `start`ed since the block's last chunk."""
        rows, block.to_prefill = block.to_prefill, []
        session = block.session
        block.logits = session.prefill(rows, params, compact=True)
        # Fed tokens land below len(stream) + budget − 1 (the last one is not fed).
        session.reserve(max(int(block.pos[r] + block.budget[r]) for r in rows))

    def _work(self, params, block: _BlockState, version: int) -> dict[int, SlotReply]:
        """A block's turn: the prefill of its new prompts, then a chunk of its live rows."""
        if block.to_prefill:
            self._prefill(params, block)
        return self._chunk(params, block, version) if block.live.any() else {}

    def decode(self, *, params=None, version: int = 0) -> dict[int, SlotReply]:
        """Advances every live row by ≤ `chunk` tokens (the blocks side by side, waiting for
        all); → {row: reply} of those that ended."""
        if self._inflight:
            raise ValueError("chunks are in flight: collect them before decode")
        self.launch(params=params, version=version)
        finished: dict[int, SlotReply] = {}
        while self._inflight:
            finished.update(self.collect())
        return finished

    def precompile(self, *, max_prompt: int | None = None, params=None) -> int:
        """Compiles every program this decoder's rollouts can call, once per sampler: the
        chunk at each row width (`_width`) and the compact prefill at each row count
        (`compact_rows`) × tail length (`compact_length`, up to `max_prompt`, default
        `max_total_len`: a prefill feeds a suffix of the prompt). With a cache of fixed size,
        whose read length attention picks at run time (`CacheExtent`), no stream length
        compiles anything later. The calls run on no row (nothing is live, every prefill row
        is padding) and change no state. → programs compiled."""
        with self.sampler.precompile_lock:  # once, whichever rollout thread comes first
            return self._precompile(max_prompt, self.sampler.params if params is None
                                    else params)

    def _precompile(self, max_prompt: int | None, params) -> int:
        sampler, done = self.sampler, 0
        lengths = sorted({compact_length(n, sampler.min_prefill_bucket)
                          for n in range(1, (max_prompt or sampler.max_total_len) + 1)})
        for block in self._blocks:
            session = block.session
            cap, max_len = session.capacity, session.cache.max_len
            extents = sampler.key_extents(max_len)
            idle = _BlockState(session)  # nothing live: each call runs no decode step
            for width in sorted({self._width(n, cap) for n in range(1, cap + 1)}):
                key = ("chunk", cap, width, max_len, self.chunk, self.max_new_bucket,
                       self.chunk_grid)
                if key not in sampler.warmed:
                    self._run_chunk_program(params, idle, np.zeros(0, np.int64), width)
                    sampler.warmed.add(key)
                    done += 1
            for length in lengths:
                for batch in sorted({compact_rows(n, cap) for n in range(1, cap + 1)}):
                    key = ("prefill", cap, batch, length, max_len)
                    if key not in sampler.warmed:
                        tokens = jnp.zeros((batch, length), jnp.int32)
                        session.cache = sampler.prefill_program(
                            params, session.cache, tokens, tokens, tokens.astype(bool),
                            jnp.full((batch,), cap, jnp.int32), jnp.int32(0),
                            extents=extents)[0]
                        sampler.warmed.add(key)
                        done += 1
        jax.block_until_ready([b.session.cache for b in self._blocks])
        return done

    def _width(self, live: int, capacity: int) -> int:
        """Rows a chunk computes: the live rows' `chunk_width` bucket, or the whole block.
        On a CPU a decode step costs in proportion to the rows it computes, and most slots
        are waiting for their environment; a mesh shards the full block's rows, so it
        always runs them all."""
        if self.sampler.mesh is not None:
            return capacity
        return chunk_width(live, capacity, self.chunk_grid)

    def _run_chunk_program(self, params, block: _BlockState, live: np.ndarray, width: int):
        """Runs the chunk program on the `live` rows of `block` as `width` input rows;
        → (program outputs less the cache, {row: its input index})."""
        session = block.session
        if block.logits is None:  # no row was ever started: nothing is fresh
            block.logits = jnp.zeros((session.capacity, self.sampler.cfg.vocab_size),
                                     jnp.float32)
        # Attention reads only the cache slots the chunk can reach (a run-time choice among
        # `key_extents`: one program for every stream length).
        extents = self.sampler.key_extents(session.cache.max_len, self.chunk_grid)
        if width < session.capacity:
            # Compact: input i runs live row live[i]; the padding inputs are not live and
            # name a row past the cache (never written).
            def rows(array: np.ndarray) -> jax.Array:
                out = np.zeros((width, *array.shape[1:]), array.dtype)
                out[: len(live)] = array[live]
                return jax.device_put(out)

            cache_rows = np.full(width, session.capacity, np.int32)
            cache_rows[: len(live)] = live
            cache_rows, at = jax.device_put(cache_rows), {int(r): i for i, r in enumerate(live)}
        else:
            rows, cache_rows, at = session.row_input, None, {int(r): int(r) for r in live}
        session.cache, *out = self._program(
            params, session.cache, block.logits, rows(block.fresh), rows(block.token),
            rows(block.pos), rows(block.live), rows(block.n_gen), rows(block.budget),
            rows(block.base_keys), rows(block.row_ids), *self._sampling, cache_rows,
            extent_index(extents, int(block.pos[live].max(initial=0)) + self.chunk),
            chunk=self.chunk, max_new_bucket=self.max_new_bucket, extents=extents)
        return out, at

    @timing.spanned("rollout/decode")
    def _chunk(self, params, block: _BlockState, version: int) -> dict[int, SlotReply]:
        session = block.session
        live = np.flatnonzero(block.live)
        width = self._width(len(live), session.capacity)
        out, at = self._run_chunk_program(params, block, live, width)
        toks, lps, steps, token, pos, n_gen, reasons = jax.device_get(out)
        self.sampler.count(decode_steps=int(steps), decode_row_steps=int(steps) * width)
        finished = {}
        for r, i in at.items():
            drawn = int(n_gen[i] - block.n_gen[r])
            block.tokens[r].extend(toks[i, :drawn].tolist())
            block.logprobs[r].append(np.asarray(lps[i, :drawn], np.float32))
            block.versions[r].append(np.full(drawn, version, np.int32))
            block.token[r], block.pos[r], block.n_gen[r] = token[i], pos[i], n_gen[i]
            block.fresh[r] = False
            if reasons[i] == 0:
                continue  # still mid-reply
            block.live[r] = False
            ids = block.tokens.pop(r)
            # Every generated token but the last was fed, so it is cached already.
            session.cached[r] += max(0, len(ids) - 1)
            session.streams[r].extend(ids)
            reason = STOP_REASONS[max(int(reasons[i]), REASON_LENGTH * (not ids))]
            finished[int(r)] = SlotReply(ids, np.concatenate(block.logprobs.pop(r)), reason,
                                         np.concatenate(block.versions.pop(r)))
        return finished


def _chunk_program(sampler):
    """The jitted chunk step of `sampler` (kept by `Sampler.program`, one per sampler: its
    compile cache holds the shapes `precompile` compiled)."""
    return jax.jit(
        functools.partial(_decode_chunk, sampler.graphdef, sampler.eos_token_id,
                          logprob_under_filter=sampler.logprob_under_filter),
        static_argnames=("chunk", "max_new_bucket", "extents"), donate_argnums=(1,),
        compiler_options=sampler.compiler_options)


def _decode_chunk(graphdef, eos_id, params, cache, fresh_logits, fresh, token, pos, live, n_gen,
                  budget, base_keys, row_ids, temperature, top_k, top_p, greedy, stop_ids,
                  cache_rows=None, key_index=None, *, chunk, max_new_bucket, extents=None,
                  logprob_under_filter=False):
    """Up to `chunk` decode steps for the `live` rows; → (cache, tokens [B, chunk],
    logprobs [B, chunk], steps run, last token, position, n_gen, reason).

    Per step every live row draws one token: a `fresh` row's first from `fresh_logits`, any
    other after feeding its last token at `pos`. The draw uses the row's uniform pair for its
    reply token `n_gen`. A row that ends stops (reason ≠ 0); the loop stops when all have.
    Input row b is cache row b, or `cache_rows[b]` when given (a compact chunk of a few rows
    of a bigger cache; indices past the cache are padding, never written). Attention reads
    the first `extents[key_index]` cache slots (`CacheExtent`).
    """
    model = nnx.merge(graphdef, params)
    if cache_rows is not None:
        fresh_logits = jnp.take(fresh_logits, cache_rows, axis=0, mode="clip")
    w_out = output_weight(model)
    batch = token.shape[0]
    row_keys = jax.vmap(jax.random.fold_in)(base_keys, row_ids)
    uniforms = row_uniforms(row_keys, max_new_bucket)

    def body(c):
        step, cache, token, pos, done, n_gen, reason, toks, lps = c
        first = fresh & (step == 0)
        feed = ~done & ~first
        hidden, cache = model.forward_with_cache(token[:, None], pos[:, None], cache,
                                                 feed[:, None], rows=cache_rows,
                                                 extents=extents, key_index=key_index)
        logits = jnp.dot(hidden[:, 0], w_out, preferred_element_type=jnp.float32)
        logits = jnp.where(first[:, None], fresh_logits, logits)
        index = jnp.minimum(n_gen, max_new_bucket - 1)
        u = jnp.take_along_axis(uniforms, index[:, None, None], axis=1)[:, 0]
        drawing = ~done
        new, logprob, n_gen, reason, finishing = draw_tokens(
            logits, u, drawing, n_gen, budget, reason, eos_id, stop_ids, temperature, top_k,
            top_p, greedy, logprob_under_filter)
        toks = toks.at[:, step].set(jnp.where(drawing, new, 0))
        lps = lps.at[:, step].set(jnp.where(drawing, logprob, 0.0))
        token = jnp.where(drawing, new, token)
        return (step + 1, cache, token, pos + feed, done | finishing, n_gen, reason, toks, lps)

    def cond(c):
        return (c[0] < chunk) & ~jnp.all(c[4])

    init = (jnp.int32(0), cache, token, pos, ~live, n_gen, jnp.zeros((batch,), jnp.int32),
            jnp.zeros((batch, chunk), jnp.int32), jnp.zeros((batch, chunk), jnp.float32))
    step, cache, token, pos, _, n_gen, reason, toks, lps = jax.lax.while_loop(cond, body, init)
    return cache, toks, lps, step, token, pos, n_gen, reason
