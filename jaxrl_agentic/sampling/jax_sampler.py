"""In-process batched generation with a static KV cache and prefix reuse across turns.

    sampler = Sampler(model, tokenizer, max_total_len=1024)
    out = sampler.generate(prompts, max_new_tokens=64, temperature=1.0, seed=0)
    out.tokens[i], out.logprobs[i], out.stop_reasons[i]        # "eos" | "stop" | "length"

The JAX backend of `protocol.SamplerBackend`. Multi-turn use goes through sessions
(`new_session`; `sessions.py`: one stream per row, prefilled only where it is new), how a
token is drawn and which logprob is reported is `draws.py`, and continuous batching over a
session's rows is `slot_decoder.py`.

Programs are compiled per bucket — rows (powers of two), prefill length (powers of two,
≥ 16), new-token budget (powers of two) and cache length (`buckets.py`) — and the parameters
are an argument, so a new policy is used without copying or recompiling. The sampler owns
its programs (`prefill_program`, `decode_program`, and those a caller adds with `program`,
such as continuous batching's chunk): jitted once per sampler, so their compile caches live
as long as it does.
"""

from __future__ import annotations

import concurrent.futures
import functools
import os
import threading
from collections.abc import Sequence

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from jaxrl_agentic.models.transformer import KVCache, Transformer
from jaxrl_agentic.sampling.buckets import check_grid, next_power_of_two
from jaxrl_agentic.sampling.draws import draw_tokens, output_weight, row_uniforms
from jaxrl_agentic.sampling.protocol import GenerationResult
from jaxrl_agentic.sampling.sessions import Session, ShardedSession
from pallas_kernels import compiler_options


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
        # decode_row_steps: Σ rows computed × steps (a step's cost on a CPU follows its rows)
        self.stats = {"prefill_tokens": 0, "prefill_calls": 0, "decode_steps": 0,
                      "decode_row_steps": 0, "prefill_shared_tokens": 0}
        # Prefill a group's identical first prompt once and copy its cache to the other
        # members (`Session.prefill`); set by runs with share_group_prefix.
        self.share_prompt_prefill = False
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
        self._added_programs: dict[str, object] = {}  # `program`'s, by name
        # Continuous batching compiles its whole shape grid at its first rollout
        # (`SlotDecoder.precompile`), or each program on first use when False.
        self.precompile_slots = precompile_slots
        self.warmed: set[tuple] = set()  # shapes `SlotDecoder.precompile` has compiled
        # Rollouts on several threads (in-flight updates) share one program per name and
        # compile the shape grid once: the first precompiles, the others wait for it.
        self._programs_lock = threading.Lock()
        self.precompile_lock = threading.Lock()
        # jit once per Sampler; the graphdef is static, everything else is an argument.
        # In bf16 on CPU, compiled so that their bits are the learner's (`_same_bits`).
        self.compiler_options = compiler_options(model.cfg.dtype)
        self.prefill_program = jax.jit(functools.partial(_prefill, self.graphdef),
                                       donate_argnums=(1,),
                                       static_argnames=("key_len", "extents"),
                                       compiler_options=self.compiler_options)
        self.decode_program = jax.jit(
            functools.partial(_decode, self.graphdef, self.eos_token_id,
                              logprob_under_filter=logprob_under_filter),
            static_argnames=("max_new_bucket",),
            donate_argnums=(1,),
            compiler_options=self.compiler_options,
        )
        # A new or grown cache is one program call, not one dispatch per layer array: eager
        # zeros per layer were a visible share of a short `generate`.
        self._zeros = jax.jit(KVCache.zeros, static_argnums=(0, 1, 2, 3))
        self._grow = jax.jit(KVCache.grow, static_argnums=(1,))

    def cache_bucket(self, end: int) -> int:
        """Cache length for streams whose tokens all lie below slot `end`."""
        return min(self.max_total_len, next_power_of_two(end, self.min_cache_bucket))

    def key_extents(self, max_len: int, grid: str = "pow2") -> tuple[int, ...]:
        """The read lengths a cache of `max_len` slots offers a run-time choice among
        (`CacheExtent`): the cache buckets below it ("pow2"; "1.5x" adds 1.5× each, as
        `buckets.chunk_width` does: a read past what the rows need is under a third, not
        half, for more branches in each program), and `max_len` itself."""
        check_grid(grid)
        extents, end = [], self.min_cache_bucket
        while end < max_len:
            extents.append(end)
            if grid == "1.5x" and 3 * end // 2 < max_len:
                extents.append(3 * end // 2)
            end *= 2
        return (*extents, max_len)

    def set_params(self, params) -> None:
        """Uses a new policy from now on (a reference, not a copy)."""
        self.params = params

    def compilation_count(self) -> int:
        """Number of distinct programs compiled so far (prefill, decode, decode chunks)."""
        added = sum(program._cache_size() for program in self._added_programs.values())
        return self.prefill_program._cache_size() + self.decode_program._cache_size() + added

    def program(self, name: str, build):
        """This sampler's jitted program `name`, made by `build(self)` on first use and kept,
        so its compile cache lives as long as the sampler (`slot_decoder`'s chunk program)."""
        with self._programs_lock:
            if name not in self._added_programs:
                self._added_programs[name] = build(self)
            return self._added_programs[name]

    def copy_rows(self, cache: KVCache, logits, copies: dict[int, int]):
        """(cache, logits) with row ``r``'s cache slots and logits those of row
        ``copies[r]``, for every ``r``; one program per power-of-two count of copies."""
        size = next_power_of_two(len(copies))
        dst = np.full(size, cache.v[0].shape[0], np.int32)  # past the rows: dropped
        src = np.zeros(size, np.int32)
        dst[:len(copies)], src[:len(copies)] = list(copies), list(copies.values())
        program = self.program("copy_rows",
                               lambda _: jax.jit(_copy_rows, donate_argnums=(0,)))
        return program(cache, logits, *jax.device_put((dst, src)))

    def empty_cache(self, rows: int, reserve: int = 0) -> KVCache:
        """A zeroed cache of `rows` rows holding slots below `reserve` (`cache_bucket`)."""
        return self._zeros(self.cfg, rows, self.cache_bucket(reserve), self.cache_dtype)

    def grown_cache(self, cache: KVCache, max_len: int) -> KVCache:
        """`cache` zero-padded to `max_len` slots."""
        return self._grow(cache, max_len)

    def new_session(self, num_rows: int, reserve: int = 0) -> Session | ShardedSession:
        """A session of `num_rows` empty streams whose cache already holds `reserve` slots:
        split into `decode_threads` row blocks when each gets `min_rows_per_thread` rows."""
        blocks = min(self.decode_threads, num_rows // self.min_rows_per_thread)
        if blocks > 1:
            return ShardedSession(self, num_rows, reserve, blocks)
        return Session(self, num_rows, reserve)

    def count(self, **counts: int) -> None:
        """Adds to `stats` (sessions' row blocks count from the pool's threads)."""
        with self._stats_lock:
            for key, n in counts.items():
                self.stats[key] += n

    def run_side_by_side(self, fn, items: list) -> list:
        """[fn(x) for x in items], run side by side on the sampler's thread pool."""
        return [f.result() for f in [self.submit(fn, x) for x in items]]

    def submit(self, fn, *args) -> concurrent.futures.Future:
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


def _copy_rows(cache: KVCache, logits, dst, src):
    def copy(x):
        return x.at[dst].set(x[src], mode="drop")

    return KVCache(k=tuple(map(copy, cache.k)), v=tuple(map(copy, cache.v))), copy(logits)


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
        token, logprob, n_gen, reason, finishing = draw_tokens(
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
