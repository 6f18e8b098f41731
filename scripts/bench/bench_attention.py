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

    python scripts/bench/bench_attention.py                       # 2,048-token rows
    python scripts/bench/bench_attention.py --row-len 4096 --rows 2
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time

import common

os.environ.setdefault("JAX_PLATFORMS", "cpu")

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402

sys.path.insert(0, common.ROOT)

from pallas_kernels.segment_attention import (  # noqa: E402
    BLOCK,
    attended_block_pairs,
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
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()
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


def _fwd_bwd(impl, seg, weights):
    def total(q, k, v):
        def row(carry, xs):
            q, k, v, s, w = xs
            out = segment_attention(q[None], k[None], v[None], s[None], impl=impl)
            return carry + jnp.sum(out.astype(jnp.float32) * w), None
        return jax.lax.scan(row, jnp.float32(0), (q, k, v, seg, weights))[0]
    return jax.jit(jax.grad(total, argnums=(0, 1, 2)))


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
    fns = {"sparse": _fwd_bwd(impl, seg, weights), "dense": _fwd_bwd("reference", seg, weights)}
    first = {}
    for name, fn in fns.items():
        start = time.perf_counter()
        jax.block_until_ready(fn(q, k, v))
        first[name] = time.perf_counter() - start
    times = {name: [] for name in fns}
    for _ in range(args.repeats):
        for name, fn in fns.items():
            start = time.perf_counter()
            jax.block_until_ready(fn(q, k, v))
            times[name].append(time.perf_counter() - start)
    sparse_s, dense_s = (statistics.median(times[n]) for n in ("sparse", "dense"))
    computed, causal = attended_block_pairs(ids)
    print(json.dumps({
        "backend": jax.default_backend(),
        "impl": impl,
        "rows": args.rows,
        "row_len": args.row_len,
        "segments": len(lengths),
        "segment_len_min_max": [min(lengths), max(lengths)],
        "real_tokens": int((ids > 0).sum()),
        "heads_kv_heads_head_dim": [args.heads, args.kv_heads, args.head_dim],
        "dtype": args.dtype,
        "block": BLOCK,
        "block_pairs_computed": computed,
        "block_pairs_causal": causal,
        "qk_pairs_dense": args.rows * args.row_len**2,
        "qk_pairs_needed": sum(n * (n + 1) // 2 for n in lengths),
        "qk_pairs_sparse": computed * BLOCK**2,
        "sparse_s": round(sparse_s, 4),
        "dense_s": round(dense_s, 4),
        "speedup": round(dense_s / sparse_s, 3),
        "first_call_s": {n: round(t, 2) for n, t in first.items()},
        "round_s": {n: [round(t, 4) for t in ts] for n, ts in times.items()},
        "loadavg_1m": [round(load_before, 2), round(os.getloadavg()[0], 2)],
        "timing": "jitted fwd+bwd (grad w.r.t. q, k, v) over all rows, one row at a time; "
                  "median of interleaved rounds after one warm-up each",
    }))


if __name__ == "__main__":
    main()
