"""Peak memory and time of full-logits vs fused token logprobs, forward + backward.

Measures ``jax.value_and_grad`` over (hidden, W) of ``Σ g·logprob`` (random per-token g) for
the reference (full [N, V] logits) and the fused path that "auto" picks on this backend
(chunked on CPU and GPU, Pallas on TPU: ``token_logprobs.resolve_impl``; ``--impl`` picks
one), and prints ONE JSON line.

Peak memory comes from XLA's memory analysis of each compiled program:
temp + argument + output − aliased bytes (what the program needs resident at once). Time is
the minimum over interleaved runs (reference, fused, reference, ...), which is the figure
least disturbed by other processes sharing the cores.

    python scripts/bench/bench_logprob.py                       # D=896, V=151936, N=4096, fp32
    python scripts/bench/bench_logprob.py --n 256 --v 8192 --repeats 1   # quick
"""

from __future__ import annotations

import argparse
import json
import sys
import time

import common
import jax
import jax.numpy as jnp

sys.path.insert(0, common.ROOT)

from pallas_kernels import choose_blocks, resolve_impl, token_logprobs  # noqa: E402
from pallas_kernels.token_logprobs import default_platform  # noqa: E402


def _parse_args():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--n", type=int, default=4096, help="tokens")
    parser.add_argument("--d", type=int, default=896, help="hidden size")
    parser.add_argument("--v", type=int, default=151936, help="vocab size")
    parser.add_argument("--block-v", type=int, default=None,
                        help="vocab block of the fused path (default: its own choice)")
    parser.add_argument("--impl", default="auto", choices=["auto", "chunked", "pallas"],
                        help="fused path to compare with the reference")
    parser.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"])
    parser.add_argument("--repeats", type=int, default=3, help="timed runs after a warm-up")
    parser.add_argument("--temperature", type=float, default=1.0)
    return parser.parse_args()


def _program(impl, targets, g, temperature, block_v):
    def loss(hidden, lm_head):
        logprobs = token_logprobs(hidden, lm_head, targets, temperature, impl=impl,
                                  block_v=block_v)
        return jnp.sum(g * logprobs)

    return jax.jit(jax.value_and_grad(loss, argnums=(0, 1)))


def _compile(impl, args, hidden, lm_head, targets, g):
    block_v = args.block_v if impl != "reference" else None
    compiled = _program(impl, targets, g, args.temperature, block_v).lower(
        hidden, lm_head).compile()
    mem = compiled.memory_analysis()
    peak = (mem.temp_size_in_bytes + mem.argument_size_in_bytes + mem.output_size_in_bytes
            - mem.alias_size_in_bytes)
    return compiled, peak


def _time_interleaved(programs, hidden, lm_head, repeats):
    """(min wall time per program, each program's warm-up output); runs alternate so both
    see the same machine load."""
    outputs = [jax.block_until_ready(run(hidden, lm_head)) for run in programs]  # warm-up
    times = [[] for _ in programs]
    for _ in range(repeats):
        for run, bucket in zip(programs, times, strict=True):
            start = time.perf_counter()
            jax.block_until_ready(run(hidden, lm_head))
            bucket.append(time.perf_counter() - start)
    return [min(t) for t in times], outputs


def _max_rel_err(fused, ref):
    """max |fused − ref| / max |ref| of the loss and of each gradient (float32)."""
    (f_val, f_grads), (r_val, r_grads) = fused, ref
    errors = {}
    for name, a, b in zip(("loss", "d_hidden", "d_lm_head"), (f_val, *f_grads),
                          (r_val, *r_grads), strict=True):
        a, b = a.astype(jnp.float32), b.astype(jnp.float32)
        scale = jnp.maximum(jnp.max(jnp.abs(b)), 1e-30)
        errors[name] = float(f"{float(jnp.max(jnp.abs(a - b)) / scale):.3g}")
    return errors


def main():
    args = _parse_args()
    dtype = jnp.dtype(args.dtype)
    keys = jax.random.split(jax.random.PRNGKey(0), 4)
    hidden = jax.random.normal(keys[0], (args.n, args.d), dtype)
    lm_head = (jax.random.normal(keys[1], (args.d, args.v), jnp.float32)
               * args.d ** -0.5).astype(dtype)
    targets = jax.random.randint(keys[2], (args.n,), 0, args.v)
    g = jax.random.normal(keys[3], (args.n,), jnp.float32)
    fused_impl = resolve_impl(args.impl)
    layout = "chunked" if fused_impl == "chunked" else (
        "gpu" if default_platform() == "gpu" else "tpu")
    block_v = args.block_v or choose_blocks(args.n, args.d, args.v, dtype, layout).block_v

    ref_run, ref_peak = _compile("reference", args, hidden, lm_head, targets, g)
    fused_run, fused_peak = _compile(fused_impl, args, hidden, lm_head, targets, g)
    (ref_s, fused_s), (ref_out, fused_out) = _time_interleaved(
        [ref_run, fused_run], hidden, lm_head, args.repeats)
    print(json.dumps({
        "impl": fused_impl,
        "backend": jax.default_backend(),
        "n": args.n, "d": args.d, "v": args.v, "dtype": args.dtype,
        "block_v": block_v,
        "ref_peak_bytes": int(ref_peak),
        "fused_peak_bytes": int(fused_peak),
        "memory_ratio": round(fused_peak / ref_peak, 4),
        "ref_s": round(ref_s, 4),
        "fused_s": round(fused_s, 4),
        "time_ratio": round(fused_s / ref_s, 4),
        "max_rel_err_vs_ref": _max_rel_err(fused_out, ref_out),
        "matmul_precision": str(jax.config.jax_default_matmul_precision),
        "peak_method": "xla_memory_analysis(temp+argument+output-alias)",
        "timing": f"min of {args.repeats} interleaved runs after 1 warm-up",
    }))


if __name__ == "__main__":
    main()
