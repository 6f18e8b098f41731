"""Does XLA's CPU backend compute bf16 matmuls faster than fp32 on this CPU? Side by side.

    python scripts/bench/bench_cpu_bf16.py [--tokens 2048] [--repeats 20]

The matmuls of one SmolLM2-135M block at a packed row of `--tokens` tokens (hidden 576,
9 query / 3 KV heads of 64, MLP 1,536), each timed in fp32 and with bf16 inputs and fp32
accumulation (`preferred_element_type=float32`, as the model's compute dtype "bfloat16"
runs them), alternating, median of `--repeats`. Prints one JSON line: GFLOP/s per shape
and dtype, `bf16_vs_fp32` (total time ratio), the CPU's bf16 instruction sets
(`/proc/cpuinfo`: avx512_bf16, amx_bf16) and the kind of fusion XLA compiled each dot to
(`__ynn_fusion`: YNNPACK, which has bf16 kernels for those instructions).
"""

from __future__ import annotations

import argparse
import json
import re
import statistics
import time


def cpu_flags() -> list[str]:
    try:
        with open("/proc/cpuinfo") as f:
            text = f.read()
    except OSError:
        return []
    return sorted(set(re.findall(r"\b(avx512_bf16|amx_bf16|amx_tile|avx512f)\b", text)))


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tokens", type=int, default=2048)
    parser.add_argument("--repeats", type=int, default=20)
    args = parser.parse_args(argv)

    import jax
    import jax.numpy as jnp
    import numpy as np

    n = args.tokens
    shapes = {"qkv": (576, 576 + 2 * 192), "o": (576, 576), "gate_up": (576, 2 * 1536),
              "down": (1536, 576)}
    rng = np.random.default_rng(0)
    out, totals = {}, {"float32": 0.0, "bfloat16": 0.0}
    fusions = {}
    for name, (d, f) in shapes.items():
        a32 = rng.standard_normal((n, d)).astype(np.float32)
        b32 = rng.standard_normal((d, f)).astype(np.float32)
        runs = {}
        for dtype in ("float32", "bfloat16"):
            a, b = jnp.asarray(a32, dtype), jnp.asarray(b32, dtype)
            fn = jax.jit(lambda a, b: jnp.dot(a, b, preferred_element_type=jnp.float32))
            compiled = fn.lower(a, b).compile()
            kinds = sorted(set(re.findall(r'"kind":"(__\w+)"', compiled.as_text())))
            fusions[f"{name}/{dtype}"] = kinds or ["dot"]
            compiled(a, b).block_until_ready()
            runs[dtype] = (compiled, a, b, [])
        for _ in range(args.repeats):  # alternate, so a change of load hits both
            for compiled, a, b, times in runs.values():
                start = time.perf_counter()
                compiled(a, b).block_until_ready()
                times.append(time.perf_counter() - start)
        for dtype, (_, _, _, times) in runs.items():
            seconds = statistics.median(times)
            totals[dtype] += seconds
            out[f"{name}_{dtype}_gflops"] = round(2 * n * d * f / seconds / 1e9, 1)
    print(json.dumps({"tokens": n, "repeats": args.repeats, "cpu_flags": cpu_flags(),
                      "jax": jax.__version__, **out,
                      "bf16_vs_fp32": round(totals["float32"] / totals["bfloat16"], 2),
                      "fusions": fusions}))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
