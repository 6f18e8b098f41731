"""The projections' `dot_general`, with a weight gradient XLA:CPU does not transpose slowly.

A projection y = x·W (x [..., T, n_in], W [n_in, n_out]) has the gradients

    dx = dy·Wᵀ,        dW = Σ_t x_tᵀ·dy_t = Xᵀ·dY    (X = x as [N, n_in], dY = dy as [N, n_out])

JAX's autodiff computes dW as (dYᵀ·X)ᵀ, a [n_out, n_in] product transposed back. On XLA:CPU
the layout pass then writes dYᵀ out as its own loop fusion: the elementwise backward that
produces dY (SwiGLU's silu′ and products for the gate, `d*`) fused with a transposed write of
N × n_out floats. At a row's power-of-two stride that write defeats the cache and can cost
more than the matmul that reads it (profiled: `docs/benchmarks.md`, "Learner").

Here dW is computed the other way round: X is transposed first, into its own buffer
(`optimization_barrier`, so XLA neither fuses the transpose into a consumer nor folds it
back into a layout change of dY), then Xᵀ [n_in, N] · dY [N, n_out] is a product of two
row-major operands. X is a buffer the forward kept, so its transpose is a plain copy, not a
fused elementwise chain. For the down projection X is the wider of the two, and the update
still gets faster: the Xᵀ copies cost less than the transposed writes they replace. dx is
autodiff's own (`jax.vjp` of the same `dot_general`), and the forward is `lax.dot_general`
unchanged, so the sampler's and the learner's forward passes compute what they did before.

Only on CPU: GPUs and TPUs hand transposed operands to their matmul units without a copy, and
the barrier would only cost them a buffer. Any other dimension numbers than a projection's
(contract x's last axis with W's first, no batch axes), or an explicit `out_sharding`, take
`lax.dot_general` as it is.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax import lax


def _is_projection(lhs, rhs, dimension_numbers) -> bool:
    (lhs_contract, rhs_contract), (lhs_batch, rhs_batch) = dimension_numbers
    return (rhs.ndim == 2 and lhs.ndim >= 2 and tuple(lhs_contract) == (lhs.ndim - 1,)
            and tuple(rhs_contract) == (0,) and not lhs_batch and not rhs_batch)


def projection_dot_general(lhs, rhs, dimension_numbers, precision=None,
                           preferred_element_type=None, out_sharding=None):
    """`lax.dot_general`'s signature (what `nnx.Linear(dot_general=...)` calls); the weight
    gradient of a projection on CPU as in the module docstring."""
    if (jax.default_backend() != "cpu" or out_sharding is not None
            or not _is_projection(lhs, rhs, dimension_numbers)):
        return lax.dot_general(lhs, rhs, dimension_numbers, precision=precision,
                               preferred_element_type=preferred_element_type,
                               out_sharding=out_sharding)
    return _projection(lhs, rhs, precision, preferred_element_type)


def _forward(x, w, precision, preferred_element_type):
    return lax.dot_general(x, w, (((x.ndim - 1,), (0,)), ((), ())), precision=precision,
                           preferred_element_type=preferred_element_type)


@functools.partial(jax.custom_vjp, nondiff_argnums=(2, 3))
def _projection(x, w, precision, preferred_element_type):
    return _forward(x, w, precision, preferred_element_type)


def _projection_fwd(x, w, precision, preferred_element_type):
    return _forward(x, w, precision, preferred_element_type), (x, w)


def _projection_bwd(precision, preferred_element_type, residuals, dy):
    x, w = residuals
    _, x_vjp = jax.vjp(lambda x: _forward(x, w, precision, preferred_element_type), x)
    (dx,) = x_vjp(dy)
    # Xᵀ in a buffer of its own: see the module docstring for why the barrier.
    x_t = lax.optimization_barrier(jnp.transpose(x.reshape(-1, x.shape[-1])))
    dw = lax.dot_general(x_t, dy.reshape(-1, dy.shape[-1]), (((1,), (0,)), ((), ())),
                         precision=precision, preferred_element_type=preferred_element_type)
    return dx, dw.astype(w.dtype)


_projection.defvjp(_projection_fwd, _projection_bwd)
