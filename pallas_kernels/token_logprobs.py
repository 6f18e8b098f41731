"""Token logprobs (and entropy) straight from hidden states and the lm head.

For hidden states ``h [N, D]``, lm head ``W [D, V]``, targets ``y [N]`` and temperature ``T``:

    z = h·W / T,    lse = log Σ_v exp(z_v),    logprob = z_y − lse,
    H = −Σ_v p_v log p_v  with  p = softmax(z)        (entropy of the tempered distribution)

Gradients, with per-token cotangents ``g_lp`` (logprob) and ``g_H`` (entropy):

    dz = g_lp·(onehot(y) − p) + g_H·(−p·(log p + H)),   dlogits = dz / T,
    dh = dlogits·Wᵀ,   dW = hᵀ·dlogits

Implementations (``impl``):
  "reference"  full ``[N, V]`` logits, ``jax.nn.log_softmax``, autodiff. The yardstick.
  "chunked"    ``lax.scan`` over vocab blocks (``_chunked``), custom VJP, never holds [N, V].
  "pallas"     Pallas kernels (``_logprob_pallas``): the Mosaic layout on TPU (and in
               interpret mode on CPU), the Triton layout on GPU.
  "auto"       TPU → pallas, GPU → chunked, CPU → chunked. On a GPU the Triton kernel is
               slower than XLA's full-logits GEMMs (its one-kernel backward ``atomic_add``s
               every [block_n, block_d] and [block_d, block_v] tile; ``docs/benchmarks.md``,
               "On a GPU"), while "chunked" is made of those same cuBLAS GEMMs plus one
               recompute and keeps the fused paths' memory bound.

Fused paths keep only ``(hidden, W, targets, lse[, H])`` as residuals and recompute logits
blockwise in the backward; all softmax math runs in fp32 whatever the input dtype. Tied
embeddings: pass ``embedding.T`` as ``lm_head``. ``temperature`` must be a Python number
(it is baked into the kernels).
"""

from __future__ import annotations

import dataclasses
import functools
from typing import NamedTuple

import jax
import jax.numpy as jnp
from jax.custom_derivatives import SymbolicZero

from pallas_kernels._chunked import chunked_backward, chunked_forward
from pallas_kernels._logprob_pallas import gpu_shared_bytes, pallas_backward, pallas_forward
from pallas_kernels._per_shard import P, per_shard, token_spec
from pallas_kernels._shapes import is_pow2, round_up
from pallas_kernels._softmax_math import matmul_precision
from pallas_kernels._target import per_target

IMPLS = ("auto", "reference", "chunked", "pallas")
FAMILIES = ("tpu", "gpu")

# Chunked path: bytes of one fp32 [N, block_v] logit tile. The scan body holds a handful of
# such tiles; 64 MiB keeps them a small fraction of the [N, V] logits the reference needs,
# while the tiles stay wide enough for an efficient matmul (see docs/kernels.md).
_CHUNK_TILE_BYTES = 64 * 2**20
# TPU: VMEM the kernels' blocks may use (16 MiB scoped default on v5e, more elsewhere).
_TPU_VMEM_BUDGET = 12 * 2**20
# GPU: aim for at least this many forward programs so every SM gets work.
_GPU_MIN_PROGRAMS = 256
# Shared memory the GPU kernels' pipelined D loop may use per program: under half of an
# H100/H200's 227 KiB per block (two programs per SM) and under an A100's 163 KiB or a
# consumer card's ~99 KiB.
_GPU_SHARED_BUDGET = 96 * 2**10


class LogprobBlocks(NamedTuple):
    """Tile sizes: tokens per block, vocab columns per block, hidden chunk (GPU only), and
    the number of vocab ranges the GPU forward splits the vocab into."""

    block_n: int
    block_v: int
    block_d: int
    vocab_splits: int


def _pow2_floor(x: int) -> int:
    return 1 << (max(int(x), 1).bit_length() - 1)


def _pow2_ceil(x: int) -> int:
    return 1 << (max(int(x), 1) - 1).bit_length()


def choose_blocks(n: int, d: int, v: int, dtype, layout: str) -> LogprobBlocks:
    """Block sizes for ``layout`` in {"chunked", "tpu", "gpu"}.

    chunked: ``block_v`` = the power of two giving a ~64 MiB fp32 [N, block_v] tile,
             clamped to [1024, 32768] and to V.
    tpu:     ``block_n`` a multiple of the sublane tile (8 rows fp32, 16 bf16) up to 256;
             ``block_v`` a multiple of 128 lanes, as wide as fits the VMEM budget (W and
             dW tiles double-buffered with dW's fp32 sums, 2·D·itemsize + 2·D·4 bytes a
             column for bf16 and fp32 alike; three fp32 [block_n, block_v] temporaries),
             at most 2048.
    gpu:     powers of two: ``block_n`` in [16, 64], ``block_v`` = 128 (64 for tiny V),
             ``block_d`` the largest power of two ≤ 128 dividing D whose pipelined tiles
             fit ``_GPU_SHARED_BUDGET`` (``gpu_shared_bytes``: 32 for fp32, 64 for bf16 at
             block_n 64, block_v 128), else the smallest that fits (D gets padded),
             and enough vocab splits for ``_GPU_MIN_PROGRAMS`` forward programs.
    """
    itemsize = jnp.dtype(dtype).itemsize
    if layout == "chunked":
        block_v = _pow2_floor(_CHUNK_TILE_BYTES // (4 * max(n, 1)))
        return LogprobBlocks(n, min(max(block_v, 1024), 32768, v), d, 1)
    if layout == "tpu":
        sublane = 8 * max(1, 4 // itemsize)
        block_n = min(256, round_up(n, sublane))
        per_column = 2 * d * itemsize + 2 * d * 4 + 3 * block_n * 4
        budget = _TPU_VMEM_BUDGET - 2 * block_n * d * itemsize
        block_v = max(128, min(2048, budget // per_column // 128 * 128))
        return LogprobBlocks(block_n, min(block_v, round_up(v, 128)), d, 1)
    if layout == "gpu":
        block_n = min(64, max(16, _pow2_ceil(n)))
        block_v = 128 if v >= 128 else max(16, _pow2_ceil(v))
        fits = [b for b in (128, 64, 32, 16)
                if gpu_shared_bytes(block_n, block_v, b, itemsize) <= _GPU_SHARED_BUDGET]
        block_d = next((b for b in fits if d % b == 0), fits[-1])
        n_blocks = -(-n // block_n)
        v_blocks = -(-v // block_v)
        splits = min(v_blocks, max(1, -(-_GPU_MIN_PROGRAMS // n_blocks)))
        return LogprobBlocks(block_n, block_v, block_d, splits)
    raise ValueError(f"unknown layout {layout!r}; expected 'chunked', 'tpu' or 'gpu'")


def _check_blocks(blocks: LogprobBlocks, layout: str) -> None:
    if layout == "tpu":
        if blocks.block_n % 8 or blocks.block_v % 128:
            raise ValueError(f"TPU blocks need block_n % 8 == 0 and block_v % 128 == 0, got "
                             f"block_n={blocks.block_n}, block_v={blocks.block_v}")
    elif layout == "gpu":
        sizes = (blocks.block_n, blocks.block_v, blocks.block_d)
        if not all(is_pow2(b) and b >= 16 for b in sizes):
            raise ValueError(f"GPU blocks must be powers of two >= 16, got {blocks}")
    elif blocks.block_v < 1:
        raise ValueError(f"block_v must be positive, got {blocks.block_v}")


def default_platform() -> str:
    """"tpu", "gpu" or "cpu" for the default JAX backend."""
    backend = jax.default_backend()
    return "gpu" if backend in ("gpu", "cuda", "rocm") else backend


def resolve_impl(impl: str, platform: str | None = None) -> str:
    """What "auto" means here: pallas on TPU, chunked on GPU and CPU (module docstring)."""
    if impl not in IMPLS:
        raise ValueError(f"unknown impl {impl!r}; expected one of {IMPLS}")
    if impl != "auto":
        return impl
    return "pallas" if (platform or default_platform()) == "tpu" else "chunked"


# ----------------------------------------------------------------------------- reference


def reference_token_logprobs(hidden, lm_head, targets, temperature=1.0, *,
                             return_entropy=False):
    """Full-logits ``log_softmax`` in fp32; autodiff gives the gradients.

    fp32 inputs are multiplied at full fp32 precision, like the fused paths: on GPU the
    default precision would be TF32 (~1e-3 logprob error, seen on an H100), which made the
    reference the least exact implementation there.
    """
    logits = jnp.dot(hidden, lm_head, preferred_element_type=jnp.float32,
                     precision=matmul_precision(hidden.dtype)) / temperature
    log_p = jax.nn.log_softmax(logits, axis=-1)
    logprobs = jnp.take_along_axis(log_p, targets.astype(jnp.int32)[:, None], axis=-1)[:, 0]
    if not return_entropy:
        return logprobs
    return logprobs, -jnp.sum(jnp.exp(log_p) * log_p, axis=-1)


# ----------------------------------------------------------------------------- fused VJP


@dataclasses.dataclass(frozen=True)
class _FusedConfig:
    impl: str  # "chunked" | "pallas"
    family: str  # "tpu" | "gpu" (pallas only)
    temperature: float
    with_entropy: bool
    blocks: LogprobBlocks
    interpret: bool | None  # None: chosen for the platform lowered for (`_target`)


def _forward(cfg: _FusedConfig, hidden, lm_head, targets):
    if cfg.impl == "chunked":
        return chunked_forward(hidden, lm_head, targets, temperature=cfg.temperature,
                               block_v=cfg.blocks.block_v, with_entropy=cfg.with_entropy)

    def run(interpret, hidden, lm_head, targets):
        return pallas_forward(hidden, lm_head, targets, temperature=cfg.temperature,
                              with_entropy=cfg.with_entropy, family=cfg.family,
                              block_n=cfg.blocks.block_n, block_v=cfg.blocks.block_v,
                              block_d=cfg.blocks.block_d,
                              vocab_splits=cfg.blocks.vocab_splits, interpret=interpret)

    return per_target(run, hidden, lm_head, targets, interpret=cfg.interpret)


def _backward(cfg: _FusedConfig, hidden, lm_head, targets, lse, g_lp, g_h, entropy):
    if cfg.impl == "chunked":
        return chunked_backward(hidden, lm_head, targets, lse, g_lp, g_h, entropy,
                                temperature=cfg.temperature, block_v=cfg.blocks.block_v)

    def run(interpret, *operands):
        return pallas_backward(*operands, temperature=cfg.temperature, family=cfg.family,
                               block_n=cfg.blocks.block_n, block_v=cfg.blocks.block_v,
                               block_d=cfg.blocks.block_d, interpret=interpret)

    return per_target(run, hidden, lm_head, targets, lse, g_lp, g_h, entropy,
                      interpret=cfg.interpret)


@functools.partial(jax.custom_vjp, nondiff_argnums=(0,))
def _fused(cfg: _FusedConfig, hidden, lm_head, targets):
    logprobs, _, entropy = _forward(cfg, hidden, lm_head, targets)
    return (logprobs, entropy) if cfg.with_entropy else logprobs


def _fused_fwd(cfg: _FusedConfig, hidden, lm_head, targets):
    # symbolic_zeros=True: primals arrive wrapped (value, perturbed).
    hidden, lm_head, targets = hidden.value, lm_head.value, targets.value
    logprobs, lse, entropy = _forward(cfg, hidden, lm_head, targets)
    if cfg.with_entropy:
        return (logprobs, entropy), (hidden, lm_head, targets, lse, entropy)
    return logprobs, (hidden, lm_head, targets, lse)


def _fused_bwd(cfg: _FusedConfig, residuals, cotangent):
    if cfg.with_entropy:
        hidden, lm_head, targets, lse, entropy = residuals
        g_lp, g_h = cotangent
    else:
        hidden, lm_head, targets, lse = residuals
        g_lp, g_h, entropy = cotangent, None, None
    # A symbolic-zero entropy cotangent (entropy only logged) skips the entropy term.
    if isinstance(g_h, SymbolicZero):
        g_h, entropy = None, None
    if isinstance(g_lp, SymbolicZero):
        if g_h is None:
            return jnp.zeros_like(hidden), jnp.zeros_like(lm_head), None
        g_lp = jnp.zeros(lse.shape, jnp.float32)
    dh, dw = _backward(cfg, hidden, lm_head, targets, lse, g_lp, g_h, entropy)
    return dh, dw, None


_fused.defvjp(_fused_fwd, _fused_bwd, symbolic_zeros=True)


# ----------------------------------------------------------------------------- public API


def _check_inputs(hidden, lm_head, targets, temperature) -> float:
    if hidden.ndim != 2 or lm_head.ndim != 2 or hidden.shape[1] != lm_head.shape[0]:
        raise ValueError(f"need hidden [N, D] and lm_head [D, V], got {hidden.shape} and "
                         f"{lm_head.shape}")
    if targets.shape != (hidden.shape[0],):
        raise ValueError(f"targets must be [N]={hidden.shape[0]}, got {targets.shape}")
    if not jnp.issubdtype(targets.dtype, jnp.integer):
        raise ValueError(f"targets must be integers, got {targets.dtype}")
    temperature = float(temperature)
    if not temperature > 0:
        raise ValueError(f"temperature must be > 0, got {temperature}")
    return temperature


def token_logprobs(hidden, lm_head, targets, temperature=1.0, *, return_entropy=False,
                   impl="auto", block_n=None, block_v=None):
    """``log_softmax(hidden @ lm_head / T)[targets]`` as fp32 ``[N]``; with
    ``return_entropy`` also the entropy ``[N]`` of the tempered distribution.

    Targets must lie in ``[0, V)``. ``block_n`` / ``block_v`` override the chosen tiles
    (see ``choose_blocks`` for the rules each layout must respect); N and V need not be
    multiples of them.
    """
    impl = resolve_impl(impl)
    temperature = _check_inputs(hidden, lm_head, targets, temperature)
    if impl == "reference":
        return reference_token_logprobs(hidden, lm_head, targets, temperature,
                                        return_entropy=return_entropy)
    if impl == "chunked":
        n, d = hidden.shape
        blocks = choose_blocks(n, d, lm_head.shape[1], hidden.dtype, "chunked")
        if block_v is not None:
            blocks = blocks._replace(block_v=int(block_v))
        _check_blocks(blocks, "chunked")
        cfg = _FusedConfig("chunked", "tpu", temperature, bool(return_entropy), blocks, False)
        return _fused(cfg, hidden, lm_head, targets)

    def kernel(hidden, lm_head, targets):
        return pallas_token_logprobs(hidden, lm_head, targets, temperature,
                                     return_entropy=return_entropy, block_n=block_n,
                                     block_v=block_v)

    # On a mesh, each device runs the kernel on its own tokens with the whole LM head
    # (`_per_shard`); the LM head's gradient is summed over devices by the shard_map.
    def specs(mesh):
        rows = token_spec(mesh, hidden.shape[0])
        tokens = P(rows)
        return ((P(rows, None), P(None, None), tokens),
                (tokens, tokens) if return_entropy else tokens)

    return per_shard(kernel, specs)(hidden, lm_head, targets)


def pallas_token_logprobs(hidden, lm_head, targets, temperature=1.0, *, return_entropy=False,
                          family=None, block_n=None, block_v=None, block_d=None,
                          vocab_splits=None, interpret=None):
    """The Pallas path with every knob exposed.

    ``family`` picks the kernel layout ("tpu": Mosaic grid with sequential vocab axis; "gpu":
    Triton with in-kernel vocab loop and atomics). Default: "gpu" on GPU, else "tpu".
    ``interpret`` None (default): interpret mode in the program lowered for a CPU, the
    compiled kernel in one lowered for a TPU or GPU, whatever the default backend
    (``_target``: a program compiled ahead of time for a TPU on a CPU host holds the Mosaic
    kernels); True / False force it.
    """
    temperature = _check_inputs(hidden, lm_head, targets, temperature)
    platform = default_platform()
    family = family or ("gpu" if platform == "gpu" else "tpu")
    if family not in FAMILIES:
        raise ValueError(f"unknown family {family!r}; expected one of {FAMILIES}")
    n, d = hidden.shape
    blocks = choose_blocks(n, d, lm_head.shape[1], hidden.dtype, family)
    overrides = {"block_n": block_n, "block_v": block_v, "block_d": block_d,
                 "vocab_splits": vocab_splits}
    blocks = blocks._replace(**{k: int(x) for k, x in overrides.items() if x is not None})
    _check_blocks(blocks, family)
    cfg = _FusedConfig("pallas", family, temperature, bool(return_entropy), blocks,
                       None if interpret is None else bool(interpret))
    return _fused(cfg, hidden, lm_head, targets)
