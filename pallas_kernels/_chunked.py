"""Vocab-chunked logprobs in plain JAX: a ``lax.scan`` over column blocks of the lm head.

Never materialises ``[N, V]``: the forward keeps only the running row statistics of
``_softmax_math``, the backward recomputes each logit block from (hidden, W) and turns it into
``dh += dz·W_bᵀ`` and ``dW_b = hᵀ·dz`` straight away. This is what "auto" runs on CPU, and it
works on any backend.

Blocks are cut with ``dynamic_slice`` at ``j·block_v`` for the ``V // block_v`` full blocks and
one static slice for the tail, so no block ever reaches past V (a dynamic slice would clamp and
silently re-read columns) and W is never padded or copied whole.
"""

from __future__ import annotations

import jax.numpy as jnp
from jax import lax

from pallas_kernels._softmax_math import (
    block_logits,
    finalize_stats,
    init_stats,
    logit_cotangent,
    matmul_precision,
    update_stats,
)


def _column_ids(start, width: int):
    return start + lax.broadcasted_iota(jnp.int32, (1, width), 1)


def chunked_forward(hidden, lm_head, targets, *, temperature: float, block_v: int,
                    with_entropy: bool):
    """Returns ``(logprobs [N], lse [N], entropy [N])`` in fp32 (entropy zeros if not asked)."""
    n = hidden.shape[0]
    v = lm_head.shape[1]
    n_full = v // block_v
    tgt = targets.astype(jnp.int32)[:, None]

    def fold(stats, w_block, start, width):
        z = block_logits(hidden, w_block, temperature)
        return update_stats(stats, z, _column_ids(start, width), tgt, with_entropy=with_entropy)

    def body(stats, j):
        start = j * block_v
        w_block = lax.dynamic_slice_in_dim(lm_head, start, block_v, axis=1)
        return fold(stats, w_block, start, block_v), None

    stats = init_stats((n, 1))
    if n_full:
        stats, _ = lax.scan(body, stats, jnp.arange(n_full, dtype=jnp.int32))
    tail = v - n_full * block_v
    if tail:
        stats = fold(stats, lm_head[:, n_full * block_v:], n_full * block_v, tail)
    logprobs, lse, entropy = finalize_stats(*stats)
    return logprobs[:, 0], lse[:, 0], entropy[:, 0]


def chunked_backward(hidden, lm_head, targets, lse, g_lp, g_h, entropy, *, temperature: float,
                     block_v: int):
    """``(dh, dW)`` for per-token cotangents ``g_lp`` (and ``g_h`` of the entropy, or None)."""
    n, d = hidden.shape
    v = lm_head.shape[1]
    n_full = v // block_v
    tgt = targets.astype(jnp.int32)[:, None]
    lse = lse[:, None]
    g_lp = g_lp.astype(jnp.float32)[:, None]
    if g_h is not None:
        g_h = g_h.astype(jnp.float32)[:, None]
        entropy = entropy[:, None]
    precision = matmul_precision(hidden.dtype)

    def grads(w_block, start, width):
        z = block_logits(hidden, w_block, temperature)
        dz = logit_cotangent(z, _column_ids(start, width), tgt, lse, g_lp, g_h, entropy)
        # Operands in the input dtype (bf16 MXU/tensor-core path), accumulation in fp32.
        dz = (dz / temperature).astype(hidden.dtype)
        dh_part = lax.dot_general(dz, w_block, (((1,), (1,)), ((), ())),
                                  preferred_element_type=jnp.float32, precision=precision)
        dw_block = lax.dot_general(hidden, dz, (((0,), (0,)), ((), ())),
                                   preferred_element_type=jnp.float32, precision=precision)
        return dh_part, dw_block.astype(lm_head.dtype)

    def body(carry, j):
        dh, dw = carry
        start = j * block_v
        w_block = lax.dynamic_slice_in_dim(lm_head, start, block_v, axis=1)
        dh_part, dw_block = grads(w_block, start, block_v)
        # Each column block of dW is written exactly once, in place in the loop carry.
        dw = lax.dynamic_update_slice_in_dim(dw, dw_block, start, axis=1)
        return (dh + dh_part, dw), None

    carry = (jnp.zeros((n, d), jnp.float32), jnp.zeros(lm_head.shape, lm_head.dtype))
    if n_full:
        carry, _ = lax.scan(body, carry, jnp.arange(n_full, dtype=jnp.int32))
    dh, dw = carry
    tail = v - n_full * block_v
    if tail:
        start = n_full * block_v
        dh_part, dw_block = grads(lm_head[:, start:], start, tail)
        dh = dh + dh_part
        dw = lax.dynamic_update_slice_in_dim(dw, dw_block, start, axis=1)
    return dh.astype(hidden.dtype), dw
