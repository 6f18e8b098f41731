"""The segment-attention kernel compiled on a GPU, against the dense reference: the value and
gradient cases of ``tests/pallas_kernels/test_flash_attention_pallas.py`` run with
``interpret=False`` (the tests force interpret mode, for CPU). Full fp32 matmuls everywhere
(``jax_default_matmul_precision="highest"``), since the fp32 cases' tolerance is 1e-5 and a
GPU otherwise runs both sides as TF32. Also ``attention_impl="cudnn"`` (cuDNN's packed
layout, bf16) on the rows of ``tests/pallas_kernels/test_cudnn_attention.py``. Prints ONE
JSON line: each case "passed" or why not.

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


def _cudnn_cases():
    """``attention_impl="cudnn"`` compiled: the CPU test's packed rows through cuDNN itself,
    values and gradients against the fp32 dense reference (bf16 tolerance). Its fallback is
    the reference ×2, so a row cuDNN was wrongly refused shows as a mismatch, not a pass."""
    import numpy as np

    import tests.pallas_kernels.test_cudnn_attention as t
    from pallas_kernels import cudnn_packed_attention

    results = {}
    for name, seg in (("cudnn_packed_rows", t.PACKED_ROWS),
                      ("cudnn_one_row_many_segments",
                       t.packed_row([37, 1, 64, 128, 9, 200, 70], 512)[None])):
        start = time.perf_counter()
        try:
            (value, grads), (ref_value, ref_grads) = t._run(
                np.asarray(seg, np.int32), max_segments=8,
                packed_attention=cudnn_packed_attention)
            assert t._close(value, ref_value, 2e-2), "value"
            for g, g_ref, which in zip(grads, ref_grads, "qkv", strict=True):
                assert t._close(g, g_ref, 2e-2), f"d{which}"
            results[name] = f"passed in {time.perf_counter() - start:.1f} s"
        except Exception as e:  # noqa: BLE001 - report, go on
            results[name] = f"FAILED {type(e).__name__}: {str(e)[:300]}"
    return results


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
    results.update(_cudnn_cases())
    print(json.dumps({"backend": jax.default_backend(),
                      "device_kind": jax.devices()[0].device_kind,
                      "all_passed": all(r.startswith("passed") for r in results.values()),
                      "cases": results}))


if __name__ == "__main__":
    main()
