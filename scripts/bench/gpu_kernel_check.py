"""The segment-attention kernel compiled on a GPU, against the dense reference: the value and
gradient cases of ``tests/pallas_kernels/test_flash_attention_pallas.py`` run with
``interpret=False`` (the tests force interpret mode, for CPU). Full fp32 matmuls everywhere
(``jax_default_matmul_precision="highest"``), since the fp32 cases' tolerance is 1e-5 and a
GPU otherwise runs both sides as TF32. Prints ONE JSON line: each case "passed" or why not.

    python scripts/bench/gpu_kernel_check.py
"""

from __future__ import annotations

import json
import sys
import time

import common
import jax

sys.path.insert(0, common.ROOT)
jax.config.update("jax_default_matmul_precision", "highest")

import tests.pallas_kernels.test_flash_attention_pallas as cases  # noqa: E402


def main():
    if jax.default_backend() != "gpu":
        raise SystemExit(f"needs a GPU (JAX runs on {jax.default_backend()!r})")
    kernel = cases.pallas_segment_attention
    cases.pallas_segment_attention = lambda *a, **kw: kernel(*a, **{**kw, "interpret": False})
    results = {}
    runs = [(c, "kv_heads") for c in cases.CASES] + [
        (c, "query_heads") for c in cases.QUERY_HEAD_GRID_CASES]
    for case, grid in runs:
        name = case if grid == "kv_heads" else f"{case}/{grid}"
        start = time.perf_counter()
        try:
            cases.test_matches_dense_reference(case, grid)
            results[name] = f"passed in {time.perf_counter() - start:.1f} s"
        except Exception as e:  # noqa: BLE001 - report every case, then go on
            results[name] = f"FAILED {type(e).__name__}: {str(e)[:300]}"
    print(json.dumps({"backend": jax.default_backend(),
                      "device_kind": jax.devices()[0].device_kind,
                      "all_passed": all(r.startswith("passed") for r in results.values()),
                      "cases": results}))


if __name__ == "__main__":
    main()
