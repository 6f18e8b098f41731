"""Blockwise softmax statistics shared by the chunked (``lax.scan``) and Pallas paths.

Everything here is a pure function of arrays, so the same code runs inside a scan body, a
Pallas kernel (TPU, GPU or interpret mode) and the tests.

Notation for one token (one row), with ``z = logits / T`` restricted to the valid vocab:

    m   = max_v z_v                      running max
    s   = Σ_v exp(z_v − m)               running sum, so lse = m + log s
    t   = z_target                       target logit (picked with an iota comparison)
    a   = Σ_v exp(z_v − m)·(z_v − m)     entropy accumulator, so H = log s − a / s

``H = −Σ p log p = lse − Σ p z`` is rewritten as ``log s − a/s`` because ``z − m ≤ 0`` keeps
every term small: the textbook ``lse − E_p[z]`` cancels catastrophically when |z| is large.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from jax import lax

# A finite stand-in for −inf. Masked logits get this value so that exp() gives exactly 0 and
# products like 0·(z − m) stay 0 instead of NaN (−inf·0), and the initial running max can be
# combined with a real one without inf − inf.
NEG_LOGIT = -1e30


# `jax_default_matmul_precision` values -> what an fp32 kernel matmul asks for.
_CONFIGURED_PRECISION = {
    "highest": lax.Precision.HIGHEST, "float32": lax.Precision.HIGHEST,
    "high": lax.Precision.HIGH, "tensorfloat32": lax.Precision.HIGH,
    "bfloat16_3x": lax.Precision.HIGH,
    "default": lax.Precision.DEFAULT, "bfloat16": lax.Precision.DEFAULT,
    "fastest": lax.Precision.DEFAULT,
}


def matmul_precision(dtype) -> lax.Precision:
    """The precision of the kernels' matmuls. Low-precision operands: DEFAULT (their own
    precision, fp32 accumulation). fp32 operands: what ``jax_default_matmul_precision`` names
    when it is set; unset, full fp32 (HIGHEST) on CPU and TPU, but TF32 (HIGH) on a GPU.

    Why the GPU differs: unset, XLA runs every other fp32 matmul of the model as TF32 there
    (as torch does with its TF32 switch on), so a full-fp32 kernel buys no end-to-end
    accuracy, and Triton lowers HIGHEST to an IEEE dot on the CUDA cores instead of the
    tensor cores (the fp32 learner at the Qwen2.5-0.5B shape ran at 2% MFU on an H200,
    ``docs/benchmarks.md``). Set ``jax_default_matmul_precision="highest"`` for full fp32
    everywhere (the GPU kernel checks do)."""
    if jnp.dtype(dtype) != jnp.float32:
        return lax.Precision.DEFAULT
    configured = jax.config.jax_default_matmul_precision
    if configured is not None:
        return _CONFIGURED_PRECISION.get(str(configured).lower(), lax.Precision.HIGHEST)
    return lax.Precision.HIGH if jax.default_backend() == "gpu" else lax.Precision.HIGHEST


def block_logits(h, w, temperature: float):
    """``z = (h @ w) / T`` in fp32 for ``h [n, d]``, ``w [d, v]`` (operands keep their dtype)."""
    z = lax.dot_general(
        h,
        w,
        (((1,), (0,)), ((), ())),
        preferred_element_type=jnp.float32,
        precision=matmul_precision(h.dtype),
    )
    return z / temperature


def mask_logits(z, col, vocab_size: int):
    """Replace logits of columns ``col ≥ V`` (ragged last block: garbage/NaN) by NEG_LOGIT."""
    return jnp.where(col < vocab_size, z, NEG_LOGIT)


def init_stats(shape):
    """Running (m, s, t, a) before any vocab block has been seen."""
    return (
        jnp.full(shape, NEG_LOGIT, jnp.float32),
        jnp.zeros(shape, jnp.float32),
        jnp.zeros(shape, jnp.float32),
        jnp.zeros(shape, jnp.float32),
    )


def update_stats(stats, z, col, targets, *, with_entropy: bool):
    """Fold one masked logit block ``z [n, bv]`` (global column ids ``col``) into the stats.

    With ``m' = max(m, max_v z_v)`` and ``α = exp(m − m')``:
        s' = α·s + Σ exp(z − m')
        a' = α·(a + (m − m')·s) + Σ exp(z − m')·(z − m')
        t' = t + Σ_v [col_v = target]·z_v
    Row statistics have shape ``[n, 1]`` (keepdims: TPU and Triton both like 2-D tiles).
    """
    m, s, t, a = stats
    m_new = jnp.maximum(m, jnp.max(z, axis=1, keepdims=True))
    alpha = jnp.exp(m - m_new)
    shifted = z - m_new
    e = jnp.exp(shifted)
    s_new = alpha * s + jnp.sum(e, axis=1, keepdims=True)
    # Exactly one column in the whole vocab matches; everywhere else this adds 0.
    t_new = t + jnp.sum(jnp.where(col == targets, z, 0.0), axis=1, keepdims=True)
    if with_entropy:
        a_new = alpha * (a + (m - m_new) * s) + jnp.sum(e * shifted, axis=1, keepdims=True)
    else:
        a_new = a
    return m_new, s_new, t_new, a_new


def combine_stats(m, s, t, a):
    """Merge partial stats computed over disjoint vocab ranges (leading axis) into one.

    ``M = max_k m_k``, ``S = Σ_k s_k·e^{m_k−M}``, ``T = Σ_k t_k``,
    ``A = Σ_k e^{m_k−M}·(a_k + (m_k − M)·s_k)``.
    """
    m_all = jnp.max(m, axis=0)
    scale = jnp.exp(m - m_all)
    s_all = jnp.sum(scale * s, axis=0)
    a_all = jnp.sum(scale * (a + (m - m_all) * s), axis=0)
    return m_all, s_all, jnp.sum(t, axis=0), a_all


def finalize_stats(m, s, t, a):
    """(logprob, lse, entropy) from final stats: ``lse = m + log s``, ``lp = t − lse``,
    ``H = log s − a/s``."""
    log_s = jnp.log(s)
    lse = m + log_s
    return t - lse, lse, log_s - a / s


def logit_cotangent(z, col, targets, lse, g_lp, g_h=None, entropy=None):
    """``dz`` for one logit block, from per-token cotangents (all row arrays ``[n, 1]``).

    With ``log p = z − lse`` and ``p = exp(log p)``:
        dz = g_lp·(onehot − p) + g_H·(−p·(log p + H))
    The entropy term is skipped when ``g_h`` is None (entropy not returned or no cotangent).
    Masked columns (z = NEG_LOGIT) have p = 0 and so get dz = 0.
    """
    log_p = z - lse
    p = jnp.exp(log_p)
    dz = g_lp * (jnp.where(col == targets, 1.0, 0.0) - p)
    if g_h is not None:
        dz = dz - g_h * p * (log_p + entropy)
    return dz
