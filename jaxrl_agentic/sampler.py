"""In-process batched generation with a static KV cache and prefix reuse across turns.

    sampler = Sampler(model, tokenizer, max_total_len=1024)
    out = sampler.generate(prompts, max_new_tokens=64, temperature=1.0, seed=0)
    out.tokens[i], out.logprobs[i], out.stop_reasons[i]        # "eos" | "stop" | "length"

Multi-turn use keeps one `Session` per batch of trajectories. Each row holds its whole token
stream on the host and remembers how much of it is already in the cache; `extend(rows, ids)`
appends tokens, and the next `generate` prefills only the part that is not cached yet. Turn
t+1 therefore costs prefill of (observation + the last sampled token), never the history:
total prefill work per trajectory is linear in its final length.

Programs are compiled per bucket — rows (powers of two), prefill length (powers of two,
≥ 16), new-token budget (powers of two) and cache length — and the parameters are an
argument, so a new policy is used without copying or recompiling. A session's cache is
static within a call but sized by the longest stream, not by `max_total_len`: it starts at
`min_cache_bucket` slots and doubles (zero-padded, at most `max_total_len`) when a call needs
more, so attention over a short stream costs what its length costs. Prefill reads only the
slots below its rows' new ends (`key_len`, a power of two), not the whole reserved cache.

On one CPU device a session of many rows is a `ShardedSession`: contiguous row blocks, each
with its own cache, generated side by side on a thread pool (one block per core), because
one decode program keeps about one core busy. Rows keep their seed ids, so the tokens are
those of a single session.

Sampling draws each token by inverting the CDF of softmax(logits / temperature) with two
uniforms per row and step (`_categorical`), all drawn before the decode loop from the row's
own key: a row's tokens depend on its seed id, not on the batch it shares.

Logprobs. Each returned logprob is log softmax(logits / temperature) at the sampled token:
the distribution the learner recomputes. Top-k / top-p only restrict *which* tokens can be
drawn (the sampling distribution is the temperature distribution renormalised over the kept
set); the logprob reported is still that of the untruncated temperature distribution, so the
importance ratio against the learner is exact. Greedy decoding takes the argmax and reports
its logprob the same way. `Sampler(..., logprob_under_filter=True)` reports instead the
logprob under the distribution actually sampled from (renormalised over the kept set), for a
learner that computes its logprobs under the same restriction
(`logprob_under_sampling_filter`): then the ratio is that of the behaviour distribution.
"""

from __future__ import annotations

import bisect
import concurrent.futures
import dataclasses
import functools
import math
import os
import threading
from collections.abc import Sequence

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from jaxrl_agentic import timing
from jaxrl_agentic.models.transformer import KVCache, Transformer
from jaxrl_agentic.parallel import kv_cache_sharding, rows_sharding
from pallas_kernels import compiler_options

STOP_REASONS = ("none", "eos", "stop", "length")
_EOS, _STOP, _LENGTH = 1, 2, 3
_MAX_STOP_IDS = 8


def next_power_of_two(n: int, minimum: int = 1) -> int:
    return max(minimum, 1 << max(0, int(n) - 1).bit_length())


@dataclasses.dataclass
class GenerationResult:
    tokens: list[list[int]]
    logprobs: list[np.ndarray]
    stop_reasons: list[str]


def _filter_logits(z: jax.Array, top_k: jax.Array, top_p: jax.Array) -> jax.Array:
    """Masks z [B, V] to the top-k tokens and then the smallest top-p mass (−inf elsewhere)."""
    sorted_z = jnp.sort(z, axis=-1)[:, ::-1]
    vocab = z.shape[-1]
    k = jnp.where(top_k > 0, jnp.minimum(top_k, vocab), vocab)
    kth = jnp.take_along_axis(sorted_z, jnp.full((z.shape[0], 1), k - 1), axis=-1)
    z = jnp.where(z < kth, -jnp.inf, z)
    # top-p over what top-k kept: keep a token if the mass strictly before it is < p.
    sorted_z = jnp.where(jnp.arange(vocab)[None] < k, sorted_z, -jnp.inf)
    probs = jax.nn.softmax(sorted_z, axis=-1)
    before = jnp.cumsum(probs, axis=-1) - probs
    keep_sorted = before < top_p
    # The smallest kept value is the threshold (ties at the threshold are kept).
    threshold = jnp.min(jnp.where(keep_sorted, sorted_z, jnp.inf), axis=-1, keepdims=True)
    return jnp.where(z < threshold, -jnp.inf, z)


def _argmax_last(x: jax.Array) -> jax.Array:
    """`jnp.argmax` over the last axis (first of ties; a NaN wins) as two plain reductions.

    XLA:CPU runs argmax's (value, index) reduction element by element; a max followed by a
    min over the matching indices vectorises and is several times faster.
    """
    top = jnp.max(x, axis=-1, keepdims=True)  # NaN if the row has one
    index = jnp.arange(x.shape[-1], dtype=jnp.int32)
    hit = (x == top) | jnp.isnan(x)
    return jnp.min(jnp.where(hit, index, x.shape[-1]), axis=-1)


def _categorical(z: jax.Array, u: jax.Array) -> jax.Array:
    """One draw per row from softmax(z) for z [B, V] (−inf entries are never drawn), given
    two uniforms u [B, 2] in [0, 1) per row.

    Inverts the CDF in two levels instead of adding V Gumbel variates: with
    p = exp(z − max z) cut into blocks of b ≈ √V (the last one zero-padded),

        block i = #{i' : C_i' ≤ u₁ · C_last},   C = cumsum of the block masses,
        token   = i·b + #{j' : c_j' ≤ u₂ · c_last},   c = cumsum of p within block i.

    Since u < 1, the first cumulative sum above u·total is the one chosen, and its own
    mass is > 0, so zero-probability tokens (and the padding) are never drawn. The draw
    is exact up to float32 rounding of the cumulative sums (~√(V/b)·2⁻²⁴ of the total
    mass) and the 2⁻²³ grid of the uniforms. Why not Gumbel-max: V random numbers per row
    per step from XLA:CPU's threefry cost 0.15 ms at [32, 576] (≈ 8 ns each), 11% of a
    decode step; at a 152k vocabulary this draw is 5× faster than the Gumbel one.
    A row with a NaN logit draws token 0; its reported logprob is NaN.
    """
    rows, vocab = z.shape
    block = next_power_of_two(math.isqrt(vocab - 1) + 1)
    num_blocks = -(-vocab // block)
    p = jnp.exp(z - jnp.max(z, axis=-1, keepdims=True))
    p = jnp.pad(p, ((0, 0), (0, num_blocks * block - vocab)))
    blocks = p.reshape(rows, num_blocks, block)
    outer = jnp.cumsum(jnp.sum(blocks, axis=-1), axis=-1)
    i = jnp.sum(outer <= u[:, :1] * outer[:, -1:], axis=-1)
    inner = jnp.cumsum(jnp.take_along_axis(blocks, i[:, None, None], axis=1)[:, 0], axis=-1)
    j = jnp.sum(inner <= u[:, 1:] * inner[:, -1:], axis=-1)
    # The min only matters for NaN rows (every comparison false).
    return jnp.minimum(i * block + j, vocab - 1)


def _sample(logits, u, temperature, top_k, top_p, greedy, logprob_under_filter=False):
    """(token [B], logprob [B]); ``u`` [B, 2] are the row's uniforms for this step (`_decode`).

    The logprob is under the untruncated temperature distribution, ``log p(y)``, or with
    ``logprob_under_filter`` under the distribution actually sampled from, renormalised over
    the top-k / top-p kept set K: ``log q(y) = z_y − logsumexp_{v ∈ K} z_v`` (what the
    learner computes with ``logprob_under_sampling_filter``, so their ratio is 1 on-policy).
    """
    z = logits.astype(jnp.float32) / temperature

    def filtered():
        needs_filter = (top_k > 0) | (top_p < 1.0)
        return jax.lax.cond(needs_filter, lambda: _filter_logits(z, top_k, top_p), lambda: z)

    if logprob_under_filter:  # the filter runs for the logprob anyway: draw from it too
        kept = filtered()
        token = jax.lax.cond(greedy, lambda: _argmax_last(z), lambda: _categorical(kept, u))
        logp = jax.nn.log_softmax(kept, axis=-1)
    else:  # the sort of the vocabulary runs only when drawing with a filter
        token = jax.lax.cond(greedy, lambda: _argmax_last(z),
                             lambda: _categorical(filtered(), u))
        logp = jax.nn.log_softmax(z, axis=-1)
    token = token.astype(jnp.int32)
    return token, jnp.take_along_axis(logp, token[:, None], axis=-1)[:, 0]


class Sampler:
    """Generates with `model`'s architecture and any params pytree of the same structure."""

    def __init__(
        self,
        model: Transformer,
        tokenizer=None,
        *,
        max_total_len: int = 1024,
        min_prefill_bucket: int = 16,
        min_cache_bucket: int = 128,
        eos_token_id: int | None = None,
        cache_dtype=None,
        mesh=None,
        decode_threads: int | None = None,
        min_rows_per_thread: int = 8,
        logprob_under_filter: bool = False,
        precompile_slots: bool = True,
    ):
        self.graphdef, self.params = nnx.split(model)
        # With a mesh, session caches and inputs are placed on it: streams split over the
        # batch axes, kv heads over `tensor` (see parallel.kv_cache_sharding).
        self.mesh = mesh
        self.cfg = model.cfg
        self.tokenizer = tokenizer
        self.max_total_len = int(max_total_len)
        self.min_prefill_bucket = min_prefill_bucket
        self.min_cache_bucket = min_cache_bucket
        if eos_token_id is None:
            eos_token_id = getattr(tokenizer, "eos_token_id", None)
        if eos_token_id is None:
            eos_token_id = self.cfg.eos_token_id
        self.eos_token_id = -1 if eos_token_id is None else int(eos_token_id)
        self.cache_dtype = cache_dtype or jnp.dtype(self.cfg.dtype)
        self.stats = {"prefill_tokens": 0, "prefill_calls": 0, "decode_steps": 0}
        self._stats_lock = threading.Lock()  # sessions' row blocks count from pool threads
        # Row blocks generated side by side (see `ShardedSession`). Default: one per core on
        # one CPU device; one elsewhere (one program fills a GPU or a TPU, and a mesh of
        # several devices already splits the rows over them).
        if decode_threads is None:
            one_cpu = jax.default_backend() == "cpu" and (mesh is None or mesh.size == 1)
            decode_threads = len(os.sched_getaffinity(0)) if one_cpu else 1
        if decode_threads < 1 or min_rows_per_thread < 1:
            raise ValueError(f"decode_threads ({decode_threads}) and min_rows_per_thread "
                             f"({min_rows_per_thread}) must be ≥ 1")
        self.decode_threads = decode_threads
        self.min_rows_per_thread = min_rows_per_thread
        self._pool = None  # a ThreadPoolExecutor, made on first use
        self.logprob_under_filter = logprob_under_filter
        self._decode_chunk = None  # continuous batching's program (`slot_decoder`), on demand
        # Continuous batching compiles its whole shape grid at its first rollout
        # (`SlotDecoder.precompile`), or each program on first use when False.
        self.precompile_slots = precompile_slots
        self.warmed: set[tuple] = set()  # shapes `SlotDecoder.precompile` has compiled
        # jit once per Sampler; the graphdef is static, everything else is an argument.
        # In bf16 on CPU, compiled so that their bits are the learner's (`_same_bits`).
        self.compiler_options = compiler_options(model.cfg.dtype)
        self._prefill = jax.jit(functools.partial(_prefill, self.graphdef), donate_argnums=(1,),
                                static_argnames=("key_len", "extents"),
                                compiler_options=self.compiler_options)
        self._decode = jax.jit(
            functools.partial(_decode, self.graphdef, self.eos_token_id,
                              logprob_under_filter=logprob_under_filter),
            static_argnames=("max_new_bucket",),
            donate_argnums=(1,),
            compiler_options=self.compiler_options,
        )
        # A new or grown cache is one program call, not one dispatch per layer array
        # (8 eager zeros cost ~4 ms per `generate` at 4 layers: 10% of a 1-token call).
        self._zeros = jax.jit(KVCache.zeros, static_argnums=(0, 1, 2, 3))
        self._grow = jax.jit(KVCache.grow, static_argnums=(1,))

    def cache_bucket(self, end: int) -> int:
        """Cache length for streams whose tokens all lie below slot `end`."""
        return min(self.max_total_len, next_power_of_two(end, self.min_cache_bucket))

    def key_extents(self, max_len: int) -> tuple[int, ...]:
        """The read lengths a cache of `max_len` slots offers a run-time choice among
        (`CacheExtent`): the cache buckets below it, and `max_len` itself."""
        extents, end = [], self.min_cache_bucket
        while end < max_len:
            extents.append(end)
            end *= 2
        return (*extents, max_len)

    def set_params(self, params) -> None:
        """Uses a new policy from now on (a reference, not a copy)."""
        self.params = params

    def compilation_count(self) -> int:
        """Number of distinct programs compiled so far (prefill, decode, decode chunks)."""
        chunks = self._decode_chunk._cache_size() if self._decode_chunk is not None else 0
        return self._prefill._cache_size() + self._decode._cache_size() + chunks

    def new_session(self, num_rows: int, reserve: int = 0) -> Session | ShardedSession:
        """A session of `num_rows` empty streams whose cache already holds `reserve` slots:
        split into `decode_threads` row blocks when each gets `min_rows_per_thread` rows."""
        blocks = min(self.decode_threads, num_rows // self.min_rows_per_thread)
        if blocks > 1:
            return ShardedSession(self, num_rows, reserve, blocks)
        return Session(self, num_rows, reserve)

    def _count(self, **counts: int) -> None:
        with self._stats_lock:
            for key, n in counts.items():
                self.stats[key] += n

    def _map(self, fn, items: list) -> list:
        """[fn(x) for x in items], run side by side on the sampler's thread pool."""
        return [f.result() for f in [self._submit(fn, x) for x in items]]

    def _submit(self, fn, *args) -> concurrent.futures.Future:
        """fn(*args) on the sampler's thread pool (`decode_threads` workers)."""
        with self._stats_lock:  # two threads (e.g. an async producer and eval) may get here
            if self._pool is None:
                self._pool = concurrent.futures.ThreadPoolExecutor(
                    self.decode_threads, thread_name_prefix="sampler")
        return self._pool.submit(fn, *args)

    def generate(
        self,
        prompts: Sequence[Sequence[int]],
        *,
        max_new_tokens: int,
        temperature: float = 1.0,
        top_p: float = 1.0,
        top_k: int = 0,
        greedy: bool = False,
        seed: int = 0,
        num_return_sequences: int = 1,
        stop_token_ids: Sequence[int] | None = None,
        params=None,
    ) -> GenerationResult:
        """Generates for each prompt (× num_return_sequences, grouped per prompt)."""
        rows = [list(p) for p in prompts for _ in range(num_return_sequences)]
        # One cache size for prefill and decode: no regrowth between them.
        session = self.new_session(len(rows), max(map(len, rows), default=0) + max_new_tokens)
        session.extend(range(len(rows)), rows)
        return session.generate(
            range(len(rows)),
            max_new_tokens=max_new_tokens,
            temperature=temperature,
            top_p=top_p,
            top_k=top_k,
            greedy=greedy,
            seed=seed,
            stop_token_ids=stop_token_ids,
            params=params,
        )


class Session:
    """A batch of token streams sharing one KV cache; rows are extended turn by turn."""

    def __init__(self, sampler: Sampler, num_rows: int, reserve: int = 0):
        self.sampler = sampler
        self.num_rows = num_rows
        self.capacity = next_power_of_two(num_rows)
        self.streams: list[list[int]] = [[] for _ in range(num_rows)]
        self.cached = np.zeros(num_rows, np.int64)  # tokens of each stream already in cache
        self.cache = self._placed(sampler._zeros(sampler.cfg, self.capacity,
                                                 sampler.cache_bucket(reserve),
                                                 sampler.cache_dtype))

    def _placed(self, cache: KVCache) -> KVCache:
        if self.sampler.mesh is None:
            return cache
        return jax.device_put(cache, kv_cache_sharding(self.sampler.mesh, cache.k[0].shape))

    def _rows(self, array: np.ndarray) -> jax.Array:
        """A per-row input, placed like the cache's rows."""
        if self.sampler.mesh is None:
            return jnp.asarray(array)
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
            self.cache = self._placed(self.sampler._grow(self.cache, max_len))

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
    def _prefill(self, rows: Sequence[int], params, compact: bool = False) -> jax.Array:
        """Feeds each row's uncached tail; returns the logits at each row's last token
        ([capacity, V]; other rows' entries are not meaningful).

        By default the program runs every row of the session (turn lockstep prefills most of
        them at once). `compact` runs only `rows`, padded to a power-of-two fraction of the
        capacity (`compact_rows`): continuous batching starts a few slots at a time, and a
        full-width prefill for each of them cost it more than its decoding (bench_rollout).
        """
        tails = {}
        for row in rows:
            if not self.streams[row]:
                raise ValueError(f"row {row}: cannot generate from an empty stream")
            if self.cached[row] == len(self.streams[row]):
                self.cached[row] -= 1  # re-feed the last token to get its logits
            tails[row] = self.streams[row][self.cached[row] :]
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
        self.sampler._count(prefill_tokens=sum(len(t) for t in tails.values()), prefill_calls=1)
        end = max(int(self.cached[row]) for row in tails)
        self.reserve(end)
        if compact:
            # The read length is chosen at run time (one program for every stream length of
            # a slot pool's fixed cache; see `key_extents`).
            extents = self.sampler.key_extents(self.cache.max_len)
            self.cache, logits = self.sampler._prefill(
                params, self.cache, jnp.asarray(tokens), jnp.asarray(positions),
                jnp.asarray(valid), jnp.asarray(index), extent_index(extents, end),
                extents=extents)
        else:
            self.cache, logits = self.sampler._prefill(
                params, self.cache, self._rows(tokens), self._rows(positions),
                self._rows(valid), None, key_len=min(
                    self.cache.max_len,
                    next_power_of_two(end, self.sampler.min_prefill_bucket)))
        return timing.ready(logits)

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
        logits = self._prefill(rows, params)

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
        self.cache, out_tokens, out_logprobs, n_gen, reasons, steps = self.sampler._decode(
            params,
            self.cache,
            logits,
            self._rows(positions.astype(np.int32)),
            self._rows(active & (budget > 0)),
            self._rows(budget),
            jax.random.PRNGKey(seed),
            self._rows(row_ids),
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
        self.sampler._count(decode_steps=int(steps))
        result = GenerationResult([], [], [])
        for row in rows:
            n = int(n_gen[row])
            ids = out_tokens[row, :n].tolist()
            result.tokens.append(ids)
            result.logprobs.append(np.asarray(out_logprobs[row, :n], np.float32))
            result.stop_reasons.append(STOP_REASONS[max(int(reasons[row]), _LENGTH * (n == 0))])
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
    parallel: two blocks of 16 rows decode 1.8× faster than one of 32 on 2 cores.
    Row r keeps seed id r (or ``row_seeds[r]``) in whichever block it lies, so the tokens
    drawn are those a single `Session` would draw. Same interface as `Session`.
    """

    def __init__(self, sampler: Sampler, num_rows: int, reserve: int, blocks: int):
        self.sampler = sampler
        self.num_rows = num_rows
        self.starts = [num_rows * i // blocks for i in range(blocks + 1)]
        self.blocks = [Session(sampler, hi - lo, reserve)
                       for lo, hi in zip(self.starts[:-1], self.starts[1:], strict=True)]

    def _locate(self, row: int) -> tuple[int, int]:
        block = bisect.bisect_right(self.starts, row) - 1
        if not 0 <= row < self.num_rows:
            raise IndexError(f"row {row} is not in this session of {self.num_rows} rows")
        return block, row - self.starts[block]

    @property
    def streams(self) -> list[list[int]]:
        return [stream for block in self.blocks for stream in block.streams]

    def length(self, row: int) -> int:
        block, local = self._locate(row)
        return self.blocks[block].length(local)

    def reset_row(self, row: int) -> None:
        block, local = self._locate(row)
        self.blocks[block].reset_row(local)

    def reserve(self, end: int) -> None:
        for block in self.blocks:
            block.reserve(end)

    def extend(self, rows: Sequence[int], new_ids: Sequence[Sequence[int]]) -> None:
        for row, ids in zip(rows, new_ids, strict=True):
            block, local = self._locate(row)
            self.blocks[block].extend([local], [ids])

    def generate(self, rows: Sequence[int], *, row_seeds: Sequence[int] | None = None,
                 **kwargs) -> GenerationResult:
        """`Session.generate` (same arguments) with each block's rows generated in parallel."""
        rows = list(rows)
        if row_seeds is None:
            row_seeds = range(self.num_rows)
        elif len(row_seeds) != self.num_rows:
            raise ValueError(f"row_seeds has {len(row_seeds)} entries for {self.num_rows} rows")
        where = [self._locate(row) for row in rows]
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
        for (b, local), out in zip(jobs, self.sampler._map(run, jobs), strict=True):
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


def _prefill(graphdef, params, cache, tokens, positions, valid, rows, key_index=None, *,
             key_len=None, extents=None):
    """Runs each input row's tail (cache row `rows[i]`, or row i when `rows` is None);
    → (cache, logits [cache rows, V] at each row's last valid token). Attention reads the
    first `key_len` slots, or `extents[key_index]` (`Transformer.forward_with_cache`)."""
    model = nnx.merge(graphdef, params)
    hidden, cache = model.forward_with_cache(tokens, positions, cache, valid, key_len, rows,
                                             extents, key_index)
    last = jnp.maximum(jnp.sum(valid, axis=1) - 1, 0)
    last_hidden = jnp.take_along_axis(hidden, last[:, None, None], axis=1)[:, 0]
    logits = model.logits(last_hidden)
    if rows is None:
        return cache, logits
    full = jnp.zeros((cache.v[0].shape[0], logits.shape[-1]), logits.dtype)
    return cache, full.at[rows].set(logits, mode="drop")


def extent_index(extents: tuple[int, ...], end: int) -> jax.Array:
    """Index of the shortest extent holding slots below `end`."""
    return jnp.int32(min(int(np.searchsorted(extents, end)), len(extents) - 1))


def compact_length(n: int, minimum: int) -> int:
    """Tokens per row of a compact prefill of tails up to `n` long: a multiple of `minimum`
    up to 4·minimum, a power of two above. Continuous batching prefills one observation
    at a time (bench_rollout: 38–40 tokens), which a power of two pads to 64."""
    if n <= 4 * minimum:
        return minimum * max(1, -(-n // minimum))
    return next_power_of_two(n)


def compact_rows(n: int, capacity: int) -> int:
    """Rows of a compact prefill of `n` rows: the smallest capacity / 2^j ≥ n (a few
    compiled shapes per session size, compiled up front by `SlotDecoder.precompile`)."""
    rows = capacity
    while rows % 2 == 0 and rows // 2 >= n:
        rows //= 2
    return rows


def stop_ids_array(temperature: float, top_p: float,
                   stop_token_ids: Sequence[int] | None) -> np.ndarray:
    """Checks the sampling arguments; → the stop ids as the decode programs take them
    ([_MAX_STOP_IDS] int32, −1 = unused)."""
    if temperature <= 0:
        raise ValueError("temperature must be > 0 (use greedy=True for argmax decoding)")
    if not 0.0 < top_p <= 1.0:
        raise ValueError(f"top_p must be in (0, 1], got {top_p}")
    stop_token_ids = list(stop_token_ids or [])
    if len(stop_token_ids) > _MAX_STOP_IDS:
        raise ValueError(f"at most {_MAX_STOP_IDS} stop_token_ids are supported")
    stops = np.full(_MAX_STOP_IDS, -1, np.int32)
    stops[: len(stop_token_ids)] = stop_token_ids
    return stops


def output_weight(model: Transformer) -> jax.Array:
    """The output projection as a [D, V] array, made once per decode call.

    Tied weights are the embedding [V, D]; used through a transpose inside the loop, XLA
    folds the transpose into the dot, whose few-row product with a [V, D] operand runs ~3×
    slower on XLA:CPU. Same dtypes as `Transformer.logits` (weights in the compute dtype,
    f32 accumulation), so bf16 models decode with the learner's numerics.
    """
    return model.lm_head_weight().astype(jnp.dtype(model.cfg.dtype))


def row_uniforms(row_keys: jax.Array, max_new_bucket: int) -> jax.Array:
    """[B, max_new_bucket, 2] uniforms: two per row per reply token, from the row's own key.

    A row's draws depend on its key only, not on the batch it shares or the process that
    runs it, nor (threefry being partitionable, JAX's default) on `max_new_bucket`: token j
    of a reply gets the same pair in one call of any bucket or in chunks (`slot_decoder`).
    Drawn up front: per step inside the loop, fold_in + uniform were two threefry
    while-loops (~90 µs).
    """
    return jax.vmap(lambda k: jax.random.uniform(k, (max_new_bucket, 2), jnp.float32))(
        row_keys)


def _draw(logits, u, live, n_gen, budget, reason, eos_id, stop_ids, temperature, top_k, top_p,
          greedy, logprob_under_filter):
    """One decode step's draw for every row: (token, logprob, n_gen, reason, finishing).

    Rows that are `live` count the token and finish on EOS, a stop id or their budget;
    `reason` records why (`_EOS` / `_STOP` / `_LENGTH`) for the rows finishing now.
    """
    token, logprob = _sample(logits, u, temperature, top_k, top_p, greedy, logprob_under_filter)
    n_gen = n_gen + live
    is_eos = token == eos_id
    is_stop = jnp.any(token[:, None] == stop_ids[None, :], axis=-1)
    new_reason = jnp.where(is_eos, _EOS, jnp.where(is_stop, _STOP, _LENGTH))
    finishing = live & (is_eos | is_stop | (n_gen >= budget))
    return token, logprob, n_gen, jnp.where(finishing, new_reason, reason), finishing


def _decode(
    graphdef,
    eos_id,
    params,
    cache,
    logits,
    positions,
    active,
    budget,
    key,
    row_ids,
    temperature,
    top_k,
    top_p,
    greedy,
    stop_ids,
    *,
    max_new_bucket,
    logprob_under_filter=False,
):
    """Samples until every row hit EOS / a stop id / its budget; one forward per step.

    The first token is drawn from the prefill logits; each loop iteration feeds the previous
    token and draws the next, so no forward runs after the last draw. A row's final token is
    therefore not fed back (nothing needs its logits yet); the session feeds it with the next
    turn's prefill.
    """
    model = nnx.merge(graphdef, params)
    w_out = output_weight(model)
    batch = logits.shape[0]
    uniforms = row_uniforms(jax.vmap(jax.random.fold_in, in_axes=(None, 0))(key, row_ids),
                            max_new_bucket)

    def draw(step, logits, state):
        done, n_gen, reason, toks, lps = state
        live = ~done
        token, logprob, n_gen, reason, finishing = _draw(
            logits, uniforms[:, step], live, n_gen, budget, reason, eos_id, stop_ids,
            temperature, top_k, top_p, greedy, logprob_under_filter)
        toks = toks.at[:, step].set(jnp.where(live, token, 0))
        lps = lps.at[:, step].set(jnp.where(live, logprob, 0.0))
        return token, (done | finishing, n_gen, reason, toks, lps)

    state = (
        ~active,
        jnp.zeros((batch,), jnp.int32),
        jnp.zeros((batch,), jnp.int32),
        jnp.zeros((batch, max_new_bucket), jnp.int32),
        jnp.zeros((batch, max_new_bucket), jnp.float32),
    )
    token, state = draw(0, logits, state)

    def cond(c):
        step, _, _, _, (done, *_), _ = c
        return (step < max_new_bucket) & ~jnp.all(done)

    def body(c):
        step, cache, token, pos, state, w_out = c
        feed = ~state[0]  # rows still generating feed their last token
        hidden, cache = model.forward_with_cache(
            token[:, None], pos[:, None], cache, feed[:, None]
        )
        logits = jnp.dot(hidden[:, 0], w_out, preferred_element_type=jnp.float32)
        token, state = draw(step, logits, state)
        return step + 1, cache, token, pos + feed, state, w_out

    step, cache, _, _, (_, n_gen, reason, toks, lps), _ = jax.lax.while_loop(
        cond, body, (jnp.int32(1), cache, token, positions, state, w_out)
    )
    steps = jnp.where(jnp.any(active), step, 0)
    return cache, toks, lps, n_gen, reason, steps
