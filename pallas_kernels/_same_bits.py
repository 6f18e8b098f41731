"""The same numbers in the sampler and the learner, to the last bit, in low precision on CPU.

`rollout/logprob_mismatch` compares the sampler's logprobs (a prefill, then one-token decode
steps against the KV cache) with the learner's recomputation (packed rows). In bf16 compute
every matmul input is rounded to bf16, so a float32 value that differs in its last bit on
the two sides now and then rounds to a different bf16 value; that is a 2⁻⁸ relative change,
and a random-weight model's layers spread it. At the Qwen2.5-0.5B shape (24 layers) the two
sides were 2.6e-3 apart (mean |Δ logprob|) with every matmul row-invariant and the attention
algorithm shared (`_online_softmax`). Three things made the last bits depend on the program
(`scripts/analysis/bf16_gap.py`, docs/benchmarks.md "bf16 agreement"):

- **Sums over a row.** XLA:CPU's reduce picks its vectorisation and tree split from the
  output's shape, so the same 896 squares (RMSNorm) or 128 probabilities (a key block's
  softmax sum) add up to other last bits for a decode's 4 rows than for a packed row of
  2,048. `fixed_order_sum` adds halves elementwise instead: one order for any shape.
- **XLA:CPU's fusion emitters** (the default code generator for fused elementwise ops and
  reductions) evaluate some ops, `exp` among them, differently in a loop's vector body and
  its scalar tail, so an element's bits depend on where it falls in the fused array. The
  classic emitters (`xla_cpu_use_fusion_emitters=False`) do not: `compiler_options`.
- **Attention over ≤ 2 key blocks** ran as one dense softmax in the sampler and in short
  learner rows, blocked online softmax elsewhere (`segment_attention.runs_dense`).

With all three, the 24-layer fixture's sampler and learner logprobs agree to 3e-7 (the
float32 noise of the LM head's logsumexp), against 2.6e-3 before. They cost ~8–10% of a
bf16 CPU pipeline step, nearly all of it the classic emitters (docs/benchmarks.md), and in
float32 compute there is no bf16 rounding to amplify a last bit (the two sides agree to
~1e-6 anyway), so all of them apply only when the compute dtype is narrower than float32, and
only on CPU (`keeps_same_bits`, the one switch every part reads): on a GPU or TPU the
sampler's cached attention and the learner's flash/splash kernels are different algorithms
anyway.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

# The XLA:CPU option that keeps an element's bits independent of its place in a fused loop.
# Other backends ignore xla_cpu_* options.
CPU_COMPILER_OPTIONS = {"xla_cpu_use_fusion_emitters": False}


def rounds_low(dtype) -> bool:
    """Whether compute in `dtype` rounds matmul inputs below float32 (bf16, fp16)."""
    return jnp.dtype(dtype).itemsize < 4


def keeps_same_bits(dtype) -> bool:
    """Low-precision compute on XLA:CPU (JAX's default backend): where this module's
    measures apply."""
    return rounds_low(dtype) and jax.default_backend() == "cpu"


def compiler_options(dtype) -> dict | None:
    """`jax.jit(..., compiler_options=...)` for a program whose numbers the sampler and the
    learner must share: `CPU_COMPILER_OPTIONS` where `keeps_same_bits`, else None (the
    default)."""
    return dict(CPU_COMPILER_OPTIONS) if keeps_same_bits(dtype) else None


def fixed_order_sum(x: jax.Array) -> jax.Array:
    """Σ over the last axis in one order for any leading shape: while the width is even,
    add its second half to its first (elementwise), then add the ≤ odd rest left to right.
    For width D = 2^a·b that is a halvings and b − 1 adds; the result drops the axis."""
    width = x.shape[-1]
    while width % 2 == 0 and width > 1:
        width //= 2
        x = x[..., :width] + x[..., width:]
    total = x[..., 0]
    for i in range(1, width):
        total = total + x[..., i]
    return total
