"""A teacher's whole next-token distribution against the student's, per generated token.

On-policy distillation's sampled estimator (``pipeline/distillation.py``) gives each
generated token the advantage ``−β·(log π_s(y_t) − log π_T(y_t))``: one token's word on a
distribution. Here each position ``t`` of the student's own episode is scored over the
whole vocabulary instead (GKD: Agarwal et al. 2024, "On-Policy Distillation of Language
Models: Learning from Self-Generated Mistakes", whose divergences these are at β = 0 and 1):

    forward_kl:  D_t = KL(π_T ‖ π_s) = Σ_v p_T(v)·(log p_T(v) − log p_s(v))
    reverse_kl:  D_t = KL(π_s ‖ π_T) = Σ_v p_s(v)·(log p_s(v) − log p_T(v))

with ``p = softmax(h·W / τ)`` of each model at the run's sampling temperature τ and the
teacher held constant (no gradient). The loss adds ``β·Σ_t w_t·D_t`` to the policy
objective, with the run's reduction weights ``w_t`` (so ``β`` is per token under
``token_mean``), divided by the same denominator as the policy loss.

**Which to use.** The reverse KL's gradient is the expectation of the sampled estimator's,
computed exactly: ``∇D_t = Σ_v p_s(v)·(log p_s(v)/p_T(v) − D_t)·∇log p_s(v)``; a move the
student gives little mass gets little push however much the teacher prefers it, so a
student far from its teacher climbs slowly (mode-seeking). The forward KL's is
``∇D_t = −Σ_v p_T(v)·∇log p_s(v)``: the cross-entropy against the teacher's soft labels at
the student's own states (DAgger's supervision), which pulls up the teacher's move
whatever the student thinks of it (mass-covering). docs/algorithms.md, "On-policy
distillation", compares them with the sampled estimator.

**What it costs.** The teacher's forward over the update's rows (no backward), and two
``[chunk, D] @ [D, V]`` head products per loss token, ``chunk_logits`` fp32 logits of each
model at a time; with ``jax.checkpoint`` on each chunk the backward recomputes them rather
than keeping every position's logits.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from jax import lax

from pallas_kernels import matmul_precision

DIVERGENCES = ("forward_kl", "reverse_kl")
# The values of `distill_loss`: "sampled", the one-token advantage (pipeline/distillation.py),
# or a divergence over the whole distribution in the learner's loss.
DISTILL_LOSSES = ("sampled", *DIVERGENCES)
# Logits of one model per chunk: 4M fp32 = 16 MiB (28 positions at a 151,936-token vocabulary).
CHUNK_LOGITS = 1 << 22


def head_logits(hidden, head):
    """``hidden [n, D] @ head [D, V]`` in fp32, the head cast to the hidden's dtype (as the
    sampler and the fused kernel use it)."""
    return jnp.dot(hidden, head.astype(hidden.dtype), preferred_element_type=jnp.float32,
                   precision=matmul_precision(hidden.dtype))


def over_position_chunks(fn, xs, vocab: int, chunk_logits: int = CHUNK_LOGITS):
    """``fn(chunk)`` over the positions of ``xs`` (a tuple of ``[N, ·]`` arrays) in chunks of
    ``chunk_logits // vocab`` positions, so that one chunk's ``[chunk, vocab]`` logits are
    held at a time; each chunk's ``[chunk]`` results joined back to ``[N]``."""
    n = xs[0].shape[0]
    chunk = max(1, min(n, chunk_logits // vocab))
    rows = tuple(jnp.pad(x, ((0, -n % chunk), (0, 0))).reshape(-1, chunk, x.shape[-1])
                 for x in xs)
    return lax.map(fn, rows).reshape(-1)[:n]


def _log_softmax(hidden, head, temperature):
    return jax.nn.log_softmax(head_logits(hidden, head) / temperature, axis=-1)


def teacher_divergence(hidden, head, teacher_hidden, teacher_head, *, kind: str,
                       temperature: float = 1.0, chunk_logits: int = CHUNK_LOGITS):
    """``[N]`` fp32: ``D_t`` (module doc) of the student's ``hidden [N, D] @ head [D, V]``
    against the teacher's ``teacher_hidden [N, D_T] @ teacher_head [D_T, V]`` at each of the
    N positions; differentiable in the student's arguments only."""
    if kind not in DIVERGENCES:
        raise ValueError(f"distill_loss: {kind!r} is not a divergence; choose one of "
                         f"{', '.join(DIVERGENCES)}")
    if head.shape[-1] != teacher_head.shape[-1]:
        raise ValueError(f"distill_loss: the teacher's head has {teacher_head.shape[-1]} "
                         f"outputs and the student's {head.shape[-1]}; a divergence over the "
                         "vocabulary needs the same one")
    teacher_hidden, teacher_head = lax.stop_gradient((teacher_hidden, teacher_head))

    @jax.checkpoint  # recompute a chunk's logits in the backward instead of storing them all
    def one(chunk_rows):
        h, g = chunk_rows
        student = _log_softmax(h, head, temperature)
        teacher = _log_softmax(g, teacher_head, temperature)
        if kind == "forward_kl":
            return jnp.sum(jnp.exp(teacher) * (teacher - student), axis=-1)
        return jnp.sum(jnp.exp(student) * (student - teacher), axis=-1)

    return over_position_chunks(one, (hidden, teacher_hidden), head.shape[-1], chunk_logits)
