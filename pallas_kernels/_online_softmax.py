"""One step of the online softmax over a block of keys, shared by the learner's block-sparse
attention and the sampler's cached attention, so that both compute the same numbers.

For queries with running max m, running sum l and unnormalised output acc, and a block of
masked scores s (float32) with values V_j:

    m' = max(m, max_s s),   α = e^{m − m'},   p = e^{s − m'} (0 where masked),
    l' = α·l + Σ_s p,       acc' = α·acc + p·V_j,

and after the last block out = acc / l, lse = m + log l (0 and 0 where nothing was attended).

Why one shared function: in bf16 the sampler's logprobs and the learner's recomputation only
agree to the last bit if both run the same operations in the same order. The learner walks a
packed row's 128-key blocks with this update (``_blocksparse_attention``); a sampler that
normalised over its whole cache in one softmax rounded different numbers to bf16 before the
P·V product and drifted ~3.5e-3 (mean |Δ logprob|) from the learner at 24 layers. With the
same update over the same blocks (keys counted from each sample's first token, so the learner
packs samples at multiples of the block: ``PackingConfig.sample_align``) the two attention
outputs are bit-identical on XLA:CPU (``tests/models/test_cached_attention.py``).
"""

from __future__ import annotations

from collections.abc import Callable

import jax
import jax.numpy as jnp

from pallas_kernels._same_bits import fixed_order_sum

# Masked scores: the logprob kernels' finite stand-in for −inf, so that a query with nothing
# attended yet keeps e^{m − m'} = 1 rather than NaN; masked probabilities are zeroed
# explicitly, never taken from exp.
from pallas_kernels._softmax_math import NEG_LOGIT as NEG


def init_state(stats_shape, acc_shape):
    """(m, l, acc) before any key block: m = NEG, l = 0, acc = 0 (float32)."""
    return (jnp.full(stats_shape, NEG, jnp.float32), jnp.zeros(stats_shape, jnp.float32),
            jnp.zeros(acc_shape, jnp.float32))


def update(m, l, acc, s, mask, pv: Callable[[jax.Array], jax.Array], fixed_order: bool = False):
    """The module docstring's step: ``s`` [..., q, k] float32 scores already scaled and
    masked with NEG, ``mask`` broadcastable to it, ``pv(p)`` the product p·V_j (float32
    [..., q, H]) of the float32 probabilities (it casts them to V's dtype). `fixed_order`:
    Σ_s p in one order whatever the batch shape (`_same_bits.fixed_order_sum`; callers set
    it where `_same_bits.keeps_same_bits`: a last bit of l can flip a bf16 rounding)."""
    m_new = jnp.maximum(m, jnp.max(s, axis=-1))
    alpha = jnp.exp(m - m_new)
    probs = jnp.where(mask, jnp.exp(s - m_new[..., None]), 0.0)
    l_new = alpha * l + (fixed_order_sum(probs) if fixed_order else jnp.sum(probs, axis=-1))
    return m_new, l_new, alpha[..., None] * acc + pv(probs)


def finish(m, l, acc):
    """(out = acc / l, lse = m + log l), 0 and 0 for queries that attended to nothing."""
    attended = l > 0
    safe_l = jnp.where(attended, l, 1.0)
    return acc / safe_l[..., None], jnp.where(attended, m + jnp.log(safe_l), 0.0)
