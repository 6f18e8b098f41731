"""Drawing a token: the math both decode programs share (`jax_sampler`, `slot_decoder`).

Sampling draws each token by inverting the CDF of softmax(logits / temperature) with two
uniforms per row and step (`categorical`), all drawn before the decode loop from the row's
own key (`row_uniforms`): a row's tokens depend on its seed id, not on the batch it shares.

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

import math
from collections.abc import Sequence

import jax
import jax.numpy as jnp
import numpy as np

from jaxrl_agentic.models.transformer import Transformer
from jaxrl_agentic.sampling.buckets import next_power_of_two

# Why a reply stopped, as the decode programs record it: an index into STOP_REASONS.
STOP_REASONS = ("none", "eos", "stop", "length")
REASON_EOS, REASON_STOP, REASON_LENGTH = 1, 2, 3
MAX_STOP_IDS = 8  # stop ids a decode program takes besides EOS


def filter_logits(z: jax.Array, top_k: jax.Array, top_p: jax.Array) -> jax.Array:
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


def argmax_last(x: jax.Array) -> jax.Array:
    """`jnp.argmax` over the last axis (first of ties; a NaN wins) as two plain reductions.

    XLA:CPU runs argmax's (value, index) reduction element by element; a max followed by a
    min over the matching indices vectorises and is several times faster.
    """
    top = jnp.max(x, axis=-1, keepdims=True)  # NaN if the row has one
    index = jnp.arange(x.shape[-1], dtype=jnp.int32)
    hit = (x == top) | jnp.isnan(x)
    return jnp.min(jnp.where(hit, index, x.shape[-1]), axis=-1)


def categorical(z: jax.Array, u: jax.Array) -> jax.Array:
    """One draw per row from softmax(z) for z [B, V] (−inf entries are never drawn), given
    two uniforms u [B, 2] in [0, 1) per row.

    Inverts the CDF in two levels instead of adding V Gumbel variates: with
    p = exp(z − max z) cut into blocks of b ≈ √V (the last one zero-padded),

        block i = #{i' : C_i' ≤ u₁ · C_last},   C = cumsum of the block masses,
        token   = i·b + #{j' : c_j' ≤ u₂ · c_last},   c = cumsum of p within block i.

    Since u < 1, the first cumulative sum above u·total is the one chosen, and its own
    mass is > 0, so zero-probability tokens (and the padding) are never drawn. The draw
    is exact up to float32 rounding of the cumulative sums (~√(V/b)·2⁻²⁴ of the total
    mass) and the 2⁻²³ grid of the uniforms. Why not Gumbel-max: it needs V random numbers
    per row per step, and XLA:CPU's threefry makes them slowly enough to be a large share of
    a decode step, more so at a real vocabulary (docs/benchmarks.md, "Sampler").
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
    """(token [B], logprob [B]); ``u`` [B, 2] are the row's uniforms for this step (`row_uniforms`).

    The logprob is under the untruncated temperature distribution, ``log p(y)``, or with
    ``logprob_under_filter`` under the distribution actually sampled from, renormalised over
    the top-k / top-p kept set K: ``log q(y) = z_y − logsumexp_{v ∈ K} z_v`` (what the
    learner computes with ``logprob_under_sampling_filter``, so their ratio is 1 on-policy).
    """
    z = logits.astype(jnp.float32) / temperature

    def filtered():
        needs_filter = (top_k > 0) | (top_p < 1.0)
        return jax.lax.cond(needs_filter, lambda: filter_logits(z, top_k, top_p), lambda: z)

    if logprob_under_filter:  # the filter runs for the logprob anyway: draw from it too
        kept = filtered()
        token = jax.lax.cond(greedy, lambda: argmax_last(z), lambda: categorical(kept, u))
        logp = jax.nn.log_softmax(kept, axis=-1)
    else:  # the sort of the vocabulary runs only when drawing with a filter
        token = jax.lax.cond(greedy, lambda: argmax_last(z),
                             lambda: categorical(filtered(), u))
        logp = jax.nn.log_softmax(z, axis=-1)
    token = token.astype(jnp.int32)
    return token, jnp.take_along_axis(logp, token[:, None], axis=-1)[:, 0]


def draw_tokens(logits, u, live, n_gen, budget, reason, eos_id, stop_ids, temperature, top_k,
                top_p, greedy, logprob_under_filter):
    """One decode step's draw for every row: (token, logprob, n_gen, reason, finishing).

    Rows that are `live` count the token and finish on EOS, a stop id or their budget;
    `reason` records why (`REASON_EOS` / `REASON_STOP` / `REASON_LENGTH`) for the rows
    finishing now.
    """
    token, logprob = _sample(logits, u, temperature, top_k, top_p, greedy, logprob_under_filter)
    n_gen = n_gen + live
    is_eos = token == eos_id
    is_stop = jnp.any(token[:, None] == stop_ids[None, :], axis=-1)
    new_reason = jnp.where(is_eos, REASON_EOS, jnp.where(is_stop, REASON_STOP, REASON_LENGTH))
    finishing = live & (is_eos | is_stop | (n_gen >= budget))
    return token, logprob, n_gen, jnp.where(finishing, new_reason, reason), finishing


def row_uniforms(row_keys: jax.Array, max_new_bucket: int) -> jax.Array:
    """[B, max_new_bucket, 2] uniforms: two per row per reply token, from the row's own key.

    A row's draws depend on its key only, not on the batch it shares or the process that
    runs it, nor (threefry being partitionable, JAX's default) on `max_new_bucket`: token j
    of a reply gets the same pair in one call of any bucket or in chunks (`slot_decoder`).
    Drawn up front: per step inside the loop, fold_in + uniform would be two threefry
    while-loops on every decode step.
    """
    return jax.vmap(lambda k: jax.random.uniform(k, (max_new_bucket, 2), jnp.float32))(
        row_keys)


def output_weight(model: Transformer) -> jax.Array:
    """The output projection as a [D, V] array, made once per decode call.

    Tied weights are the embedding [V, D]; used through a transpose inside the loop, XLA
    folds the transpose into the dot, whose few-row product with a [V, D] operand runs
    several times slower on XLA:CPU. Same dtypes as `Transformer.logits` (weights in the
    compute dtype, f32 accumulation), so bf16 models decode with the learner's numerics.
    """
    return model.lm_head_weight().astype(jnp.dtype(model.cfg.dtype))


def stop_ids_array(temperature: float, top_p: float,
                   stop_token_ids: Sequence[int] | None) -> np.ndarray:
    """Checks the sampling arguments; → the stop ids as the decode programs take them
    ([MAX_STOP_IDS] int32, −1 = unused)."""
    if temperature <= 0:
        raise ValueError("temperature must be > 0 (use greedy=True for argmax decoding)")
    if not 0.0 < top_p <= 1.0:
        raise ValueError(f"top_p must be in (0, 1], got {top_p}")
    stop_token_ids = list(stop_token_ids or [])
    if len(stop_token_ids) > MAX_STOP_IDS:
        raise ValueError(f"at most {MAX_STOP_IDS} stop_token_ids are supported")
    stops = np.full(MAX_STOP_IDS, -1, np.int32)
    stops[: len(stop_token_ids)] = stop_token_ids
    return stops
