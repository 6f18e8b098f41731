"""Token logprobs under the sampler's top-k / top-p support restriction.

A top-k / top-p sampler draws from the tempered distribution renormalised over a kept set
``K`` (``jaxrl_agentic.sampling.draws.filter_logits``), so the behaviour probability of a drawn
token is

    q(y) = p(y) / Σ_{v ∈ K} p(v),      log q(y) = z_y − logsumexp_{v ∈ K} z_v,   z = logits / T

while ``token_logprobs`` returns ``log p(y)``, off by the log of the kept mass. An importance
ratio built from unrestricted logprobs is therefore that of a distribution nobody sampled
from; :func:`restricted_token_logprobs` returns ``log q`` so the ratio (and TIS) compares the
distributions actually used.

The kept set is exactly the sampler's (same ops in the same order, :func:`support_mask`):
top-k keeps ``z ≥ z_(k)`` (ties with the k-th value stay); top-p then takes the values sorted
in descending order, the first k of them (all V without top-k), their softmax ``π`` and keeps
a value if the mass strictly before it is ``< p``; every ``z ≥`` the smallest kept value
stays. Membership is a step function of the logits and carries no gradient; the gradient is
that of ``log q`` on the fixed set: ``dz = onehot(y) − q`` on K, 0 elsewhere.

A target outside K (possible when the params moved since sampling, or for a token the
sampler did not draw) has ``q = 0``; it gets ``OUT_OF_SUPPORT_LOGPROB`` (finite, so that
products such as CISPO's ``A·logp`` or the k1 KL stay finite) and zero gradient.

This is a jnp path only (no Pallas kernel): sorting the vocabulary is needed for top-p and
does not fit the fused kernels' vocab-blocked streaming. It never materialises ``[N, V]``:
``lax.map`` runs over token blocks of ``block_n`` rows, each holding a few fp32
``[block_n, V]`` tiles (~16 MiB each by default), and ``jax.checkpoint`` makes the backward
recompute a block's logits instead of storing them. Membership is computed on the learner's
fp32 logits; where the sampler's logits differ (bf16, other kernels) a token exactly at the
boundary can fall on the other side — such a token's ratio is then off by that mass.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax import lax

from pallas_kernels._softmax_math import matmul_precision

OUT_OF_SUPPORT_LOGPROB = -1e4
_TILE_BYTES = 16 * 2**20


def support_mask(z: jax.Array, top_k: int = 0, top_p: float = 1.0) -> jax.Array:
    """Bool ``[n, V]``: the tokens the sampler may draw from tempered logits ``z [n, V]``.

    The same computation as ``jaxrl_agentic.sampling.draws.filter_logits`` (there as −inf masking);
    ``top_k = 0`` means no top-k, ``top_p = 1`` no top-p.
    """
    vocab = z.shape[-1]
    sorted_z = jnp.sort(z, axis=-1)[:, ::-1]
    k = min(int(top_k), vocab) if top_k > 0 else vocab
    kth = sorted_z[:, k - 1:k]
    kept = z >= kth
    sorted_z = jnp.where(jnp.arange(vocab)[None] < k, sorted_z, -jnp.inf)
    probs = jax.nn.softmax(sorted_z, axis=-1)
    before = jnp.cumsum(probs, axis=-1) - probs
    keep_sorted = before < top_p
    threshold = jnp.min(jnp.where(keep_sorted, sorted_z, jnp.inf), axis=-1, keepdims=True)
    return kept & (z >= threshold)


def _block(hidden, lm_head, targets, *, temperature, top_k, top_p, with_entropy):
    z = jnp.dot(hidden, lm_head, preferred_element_type=jnp.float32,
                precision=matmul_precision(hidden.dtype)) / temperature
    keep = support_mask(lax.stop_gradient(z), top_k, top_p)
    # A finite fill (not −inf): exp gives exactly 0 and 0·(z − lse) stays 0 in the entropy.
    masked = jnp.where(keep, z, -1e30)
    log_q = masked - jax.nn.logsumexp(masked, axis=-1, keepdims=True)
    pick = jnp.arange(z.shape[-1])[None] == targets[:, None]
    in_support = jnp.any(pick & keep, axis=-1)
    target_log_q = jnp.sum(jnp.where(pick, log_q, 0.0), axis=-1)
    logprobs = jnp.where(in_support, target_log_q, OUT_OF_SUPPORT_LOGPROB)
    if not with_entropy:
        return logprobs
    entropy = -jnp.sum(jnp.where(keep, jnp.exp(log_q) * log_q, 0.0), axis=-1)
    return logprobs, entropy


def restricted_token_logprobs(hidden, lm_head, targets, temperature=1.0, *, top_k: int = 0,
                              top_p: float = 1.0, return_entropy: bool = False,
                              block_n: int | None = None):
    """``log q(y)`` (module doc) as fp32 ``[N]`` for ``hidden [N, D]``, ``lm_head [D, V]``,
    ``targets [N]``; with ``return_entropy`` also the entropy of ``q`` (the distribution
    sampled from). ``top_k``, ``top_p`` and ``temperature`` are the sampler's settings
    (Python numbers). Without a restriction (``top_k = 0``, ``top_p = 1``) this equals
    ``token_logprobs``; call that instead, it is fused.
    """
    if hidden.ndim != 2 or lm_head.ndim != 2 or hidden.shape[1] != lm_head.shape[0]:
        raise ValueError(f"need hidden [N, D] and lm_head [D, V], got {hidden.shape} and "
                         f"{lm_head.shape}")
    if targets.shape != (hidden.shape[0],):
        raise ValueError(f"targets must be [N]={hidden.shape[0]}, got {targets.shape}")
    if not 0.0 < top_p <= 1.0 or top_k < 0 or not temperature > 0:
        raise ValueError(f"need top_k >= 0, 0 < top_p <= 1, temperature > 0; got {top_k}, "
                         f"{top_p}, {temperature}")
    n, v = hidden.shape[0], lm_head.shape[1]
    if block_n is None:
        block_n = max(1, min(n, _TILE_BYTES // (4 * v)))
    n_blocks = -(-n // block_n)
    pad = n_blocks * block_n - n
    h = jnp.pad(hidden, ((0, pad), (0, 0))).reshape(n_blocks, block_n, -1)
    y = jnp.pad(targets.astype(jnp.int32), (0, pad)).reshape(n_blocks, block_n)
    body = jax.checkpoint(functools.partial(
        _block, lm_head=lm_head, temperature=float(temperature), top_k=int(top_k),
        top_p=float(top_p), with_entropy=bool(return_entropy)))
    out = lax.map(lambda xs: body(xs[0], targets=xs[1]), (h, y))
    if return_entropy:
        return tuple(o.reshape(-1)[:n] for o in out)
    return out.reshape(-1)[:n]
