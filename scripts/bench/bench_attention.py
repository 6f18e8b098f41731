"""Segment-aware attention vs dense masked attention on packed rows: block pairs and time.

Packs random sample lengths (``--min-len``..``--max-len``, first-fit in arrival order) into
``--rows`` rows of ``--row-len`` tokens, then times forward + backward (the gradient of a
random linear functional of the output w.r.t. q, k, v, jitted) of

* ``sparse``: ``segment_attention(impl=--impl)`` (default the backend's "auto": the
  block-sparse loop on CPU), which computes only the (query block, key block) pairs the
  segments need;
* ``dense``: ``segment_attention(impl="reference")``, masked attention over the whole row.

Rows are processed one at a time (``lax.scan``), as the learner's train step does on one
device. Shapes default to the 25m model's attention (8 heads, 2 kv heads, head_dim 64).
Reported: block pairs computed by the sparse path and in the causal triangle
(``attended_block_pairs``), query-key pairs the dense path computes (rows · row_len²) and
the segments need (Σ L(L+1)/2), median times of ``--repeats`` interleaved rounds after one
warm-up (compile) each, ``speedup`` = dense / sparse. Prints ONE JSON line.

``--device gpu`` (JAX on cuda; "auto" is then the Pallas flash kernel) adds two cuDNN
timings through ``jax.nn.dot_product_attention(implementation="cudnn")``:

* ``cudnn_padded``: the same samples as a padded batch (one sample per row, rows of the
  longest sample rounded up to 128, ``query_seq_lengths``/``key_value_seq_lengths`` and
  ``is_causal``): exact, the layout a learner without segment-aware attention would use;
* ``cudnn_row_causal``: plain causal attention over each packed row, segments ignored. NOT
  the same function (it attends across samples); it shows cuDNN's rate on the row's shape
  and what a packed layout costs when the kernel cannot skip.

and ``useful_tflops`` for each: the FLOPs the segments need, ``4·N·H·Σ L(L+1)/2`` for the
forward (QKᵀ and PV) and 3.5× that for forward + backward (the two forward products and the
five of FlashAttention-2's backward), over each implementation's median time, so every
implementation is credited with the same work and the ratios are time ratios. The dense
reference is skipped above ``--dense-max-len`` (its T² fp32 scores). ``max_abs_diff_vs``: the
sparse path's forward output against the dense reference and cuDNN padded, over the real
tokens (not timed): the timed paths compute one function. ``--forward-only``
times the forward alone (what logprob passes and prefill run). ``--dkdv-grid both`` (with
``--impl pallas``) also times the kernel with its dK/dV grid over query heads instead of kv
heads (case ``sparse_query_heads``; ``speedup_of_query_heads_grid`` = sparse /
sparse_query_heads, so > 1 means the query-head grid is faster).

    python scripts/bench/bench_attention.py                       # 2,048-token rows
    python scripts/bench/bench_attention.py --row-len 4096 --rows 2
    python scripts/bench/bench_attention.py --device gpu --row-len 16384 --rows 2 \
        --heads 14 --kv-heads 2 --head-dim 64 --dtype bfloat16 --min-len 256 --max-len 2048
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time

import common

DEVICE = common.configure()  # JAX_PLATFORMS, before jax is imported

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402

sys.path.insert(0, common.ROOT)

from pallas_kernels import DKDV_GRIDS, matmul_precision  # noqa: E402
from pallas_kernels.segment_attention import (  # noqa: E402
    BLOCK,
    attended_block_pairs,
    attention_block,
    resolve_attention_impl,
    segment_attention,
)


def _parse_args():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rows", type=int, default=4)
    parser.add_argument("--row-len", type=int, default=2048)
    parser.add_argument("--min-len", type=int, default=100)
    parser.add_argument("--max-len", type=int, default=700)
    parser.add_argument("--heads", type=int, default=8)
    parser.add_argument("--kv-heads", type=int, default=2)
    parser.add_argument("--head-dim", type=int, default=64)
    parser.add_argument("--dtype", default="float32")
    parser.add_argument("--impl", default="auto")
    parser.add_argument("--block", type=int, default=None,
                        help="tokens per block of the sparse path (default: segment_attention's "
                             "own, attention_block: 128 on CPU, by dtype and head_dim on GPU)")
    parser.add_argument("--dkdv-grid", choices=(*DKDV_GRIDS, "both"), default="kv_heads",
                        help="the Pallas backward's dK/dV grid; both: time the query-head "
                             "grid too, as case sparse_query_heads, beside the kv-head one")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--forward-only", action="store_true",
                        help="time the forward alone (default: forward + backward)")
    parser.add_argument("--dense-max-len", type=int, default=8192,
                        help="skip the dense reference on longer rows (its T² scores)")
    parser.add_argument("--device", choices=("cpu", "gpu"), default="cpu",
                        help="cpu (default), or gpu: adds the cuDNN timings (spell it out: "
                             "read before jax is imported)")
    args = parser.parse_args()
    common.check_flag(parser, args.device, DEVICE)
    if args.device == "gpu":
        common.require_jax_gpu(parser.error)
    if not 0 < args.min_len <= args.max_len <= args.row_len:
        parser.error("need 0 < --min-len <= --max-len <= --row-len (samples must fit a row)")
    return args


def packed_segment_ids(rows, row_len, min_len, max_len, rng):
    """[rows, row_len] ids: samples of random lengths laid out first-fit, padding at the end."""
    ids = np.zeros((rows, row_len), np.int32)
    lengths = []
    for r in range(rows):
        start, seg = 0, 1
        while True:
            n = int(rng.integers(min_len, max_len + 1))
            if start + n > row_len:
                break
            ids[r, start:start + n] = seg
            lengths.append(n)
            start, seg = start + n, seg + 1
    return ids, lengths


def _timed(loss, forward_only: bool):
    """Jitted forward (``loss``) or its gradient w.r.t. q, k, v."""
    return jax.jit(loss if forward_only else jax.grad(loss, argnums=(0, 1, 2)))


def _packed_loss(impl, seg, weights, block=None, dkdv_grid="kv_heads"):
    """Σ out·w over the packed rows, one row at a time (as the train step's micro-batches)."""
    def total(q, k, v):
        def row(carry, xs):
            q, k, v, s, w = xs
            out = segment_attention(q[None], k[None], v[None], s[None], impl=impl, block=block,
                                    dkdv_grid=dkdv_grid)
            return carry + jnp.sum(out.astype(jnp.float32) * w), None
        return jax.lax.scan(row, jnp.float32(0), (q, k, v, seg, weights))[0]
    return total


def _cudnn_row_causal_loss(weights):
    """Σ out·w of cuDNN causal attention over each whole packed row (segments ignored)."""
    def total(q, k, v):
        out = jax.nn.dot_product_attention(q, k, v, is_causal=True, implementation="cudnn")
        return jnp.sum(out.astype(jnp.float32) * weights)
    return total


def _cudnn_padded_attention(q, k, v, lens):
    """cuDNN causal attention over a padded batch (one sample per row, `lens` real tokens)."""
    return jax.nn.dot_product_attention(q, k, v, is_causal=True, query_seq_lengths=lens,
                                        key_value_seq_lengths=lens, implementation="cudnn")


def _cudnn_padded_loss(lengths, weights):
    """Σ out·w of `_cudnn_padded_attention`."""
    lens = jnp.asarray(lengths, jnp.int32)

    def total(q, k, v):
        out = _cudnn_padded_attention(q, k, v, lens)
        return jnp.sum(out.astype(jnp.float32) * weights)
    return total


def padded_batch(x, ids, lengths, width):
    """[samples, width, ...] copy of packed ``x`` [rows, T, ...]: sample n (segment id s of
    row r, in the order `packed_segment_ids` laid them out) at row n, zeros after it."""
    x = np.asarray(x)
    out = np.zeros((len(lengths), width) + x.shape[2:], x.dtype)
    n = 0
    for r in range(ids.shape[0]):
        for s in range(1, int(ids[r].max()) + 1):
            cols = np.flatnonzero(ids[r] == s)
            out[n, :cols.size] = x[r, cols]
            n += 1
    return out


def forward_diffs(impl, q, k, v, seg, ids, lengths, dense, padded, block=None):
    """Max |Δ| (float32) of the sparse path's forward output against the dense reference
    (if `dense`) and cuDNN on the padded batch (if `padded`, its q, k, v are given), over the
    real tokens: the timed paths compute the same function at this shape."""
    width = -(-max(lengths) // BLOCK) * BLOCK
    mask = np.arange(width)[None, :] < np.asarray(lengths)[:, None]

    def packed(impl):
        out = jax.jit(lambda q, k, v: segment_attention(q, k, v, seg, impl=impl,
                                                        block=block))(q, k, v)
        return padded_batch(np.asarray(out.astype(jnp.float32)), ids, lengths, width)

    sparse = packed(impl)
    others = {"dense": packed("reference")} if dense else {}
    if padded is not None:
        out = _cudnn_padded_attention(*padded, jnp.asarray(lengths, jnp.int32))
        others["cudnn_padded"] = np.asarray(out.astype(jnp.float32))
    return {name: float(np.abs(sparse - other)[mask].max()) for name, other in others.items()}


def useful_flops(lengths, heads, head_dim, forward_only):
    """FLOPs the segments need: 4·N·H·Σ L(L+1)/2 forward, 3.5× that forward + backward."""
    forward = 4 * heads * head_dim * sum(n * (n + 1) // 2 for n in lengths)
    return forward if forward_only else 3.5 * forward


def main():
    args = _parse_args()
    load_before = os.getloadavg()[0]
    rng = np.random.default_rng(args.seed)
    ids, lengths = packed_segment_ids(args.rows, args.row_len, args.min_len, args.max_len, rng)
    dtype = jnp.dtype(args.dtype)

    def draw(heads):
        shape = (args.rows, args.row_len, heads, args.head_dim)
        return jnp.asarray(rng.normal(size=shape), dtype)

    q, k, v = draw(args.heads), draw(args.kv_heads), draw(args.kv_heads)
    weights = jnp.asarray(rng.normal(size=q.shape), jnp.float32)
    seg = jnp.asarray(ids)
    impl = resolve_attention_impl(args.impl)
    args.block = args.block or attention_block(impl, dtype, args.head_dim)
    # name -> (jitted function, its inputs)
    grid = "kv_heads" if args.dkdv_grid == "both" else args.dkdv_grid
    cases = {"sparse": (_timed(_packed_loss(impl, seg, weights, args.block, grid),
                               args.forward_only), (q, k, v))}
    if args.dkdv_grid == "both":
        cases["sparse_query_heads"] = (
            _timed(_packed_loss(impl, seg, weights, args.block, "query_heads"),
                   args.forward_only), (q, k, v))
    if args.row_len <= args.dense_max_len:
        cases["dense"] = (_timed(_packed_loss("reference", seg, weights), args.forward_only),
                          (q, k, v))
    padded = None
    if args.device == "gpu":
        width = -(-max(lengths) // BLOCK) * BLOCK
        padded = tuple(jnp.asarray(padded_batch(x, ids, lengths, width)) for x in (q, k, v))
        padded_w = jnp.asarray(padded_batch(weights, ids, lengths, width))
        cases["cudnn_padded"] = (_timed(_cudnn_padded_loss(lengths, padded_w),
                                        args.forward_only), padded)
        cases["cudnn_row_causal"] = (_timed(_cudnn_row_causal_loss(weights), args.forward_only),
                                     (q, k, v))
    first, errors = {}, {}
    for name, (fn, inputs) in list(cases.items()):
        start = time.perf_counter()
        try:
            jax.block_until_ready(fn(*inputs))
        except Exception as e:  # noqa: BLE001 - a backend without this path: say so, go on
            errors[name] = f"{type(e).__name__}: {str(e).splitlines()[0][:300]}"
            del cases[name]
            continue
        first[name] = time.perf_counter() - start
    times = {name: [] for name in cases}
    for _ in range(args.repeats):
        for name, (fn, inputs) in cases.items():
            start = time.perf_counter()
            jax.block_until_ready(fn(*inputs))
            times[name].append(time.perf_counter() - start)
    median = {name: statistics.median(ts) for name, ts in times.items()}
    diffs = forward_diffs(impl, q, k, v, seg, ids, lengths, "dense" in cases,
                          padded if "cudnn_padded" in cases else None, args.block) \
        if "sparse" in cases else {}
    flops = useful_flops(lengths, args.heads, args.head_dim, args.forward_only)
    computed, causal = attended_block_pairs(ids, args.block)
    record = {
        "backend": jax.default_backend(),
        "device_kind": jax.devices()[0].device_kind,
        "impl": impl,
        "rows": args.rows,
        "row_len": args.row_len,
        "segments": len(lengths),
        "segment_len_min_max": [min(lengths), max(lengths)],
        "real_tokens": int((ids > 0).sum()),
        "heads_kv_heads_head_dim": [args.heads, args.kv_heads, args.head_dim],
        "dtype": args.dtype,
        "pass": "forward" if args.forward_only else "forward+backward",
        "block": args.block,
        "dkdv_grid": args.dkdv_grid,
        "kernel_fp32_matmul_precision": str(matmul_precision(jnp.float32)),
        "block_pairs_computed": computed,
        "block_pairs_causal": causal,
        "qk_pairs_dense": args.rows * args.row_len**2,
        "qk_pairs_needed": sum(n * (n + 1) // 2 for n in lengths),
        "qk_pairs_sparse": computed * args.block**2,
        **{f"{name}_s": round(t, 5) for name, t in median.items()},
        "useful_flops": flops,
        "useful_tflops": {name: round(flops / t / 1e12, 2) for name, t in median.items()},
        "first_call_s": {n: round(t, 2) for n, t in first.items()},
        "round_s": {n: [round(t, 5) for t in ts] for n, ts in times.items()},
        "max_abs_diff_vs": {n: float(f"{d:.3g}") for n, d in diffs.items()},
        "errors": errors,
        "loadavg_1m": [round(load_before, 2), round(os.getloadavg()[0], 2)],
        "timing": ("jitted " + ("forward" if args.forward_only else
                                "fwd+bwd (grad w.r.t. q, k, v)")
                   + " over all rows, one row at a time (cuDNN padded: one batch); "
                     "median of interleaved rounds after one warm-up each"),
    }
    if "dense" in median and "sparse" in median:
        record["speedup"] = round(median["dense"] / median["sparse"], 3)
    if "sparse_query_heads" in median and "sparse" in median:  # > 1: the query-head grid wins
        record["speedup_of_query_heads_grid"] = round(
            median["sparse"] / median["sparse_query_heads"], 3)
    for name in ("cudnn_padded", "cudnn_row_causal"):
        if name in median and "sparse" in median:
            record[f"speedup_vs_{name}"] = round(median[name] / median["sparse"], 3)
    print(json.dumps(record))


if __name__ == "__main__":
    main()
