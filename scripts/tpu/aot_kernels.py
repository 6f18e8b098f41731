"""Compile the fused logprob kernel for a TPU topology on a machine without a TPU.

Needs ``libtpu`` (``pip install "jax[tpu]"``, in its own environment: docs/tpu.md, "Compile
for a TPU without one"). For each ``impl`` this compiles the gradient of

    Σ_t token_logprobs(h, W, y)_t      w.r.t. (h, W),   h [N, D] bf16, W [D, V] bf16

for the chips of ``--topology`` and prints one JSON line with the compiler's per-chip bytes
(``compiled.memory_analysis()``) and the number of Mosaic kernels in the compiled program
(0 means the Pallas kernels ran as interpreted XLA loops, not as TPU kernels).

``--layout one_chip``: the program for one chip of the topology (all N tokens there);
``--layout mesh``: one program over every chip, tokens split over a ``data`` mesh axis (the
kernels then run per chip under ``shard_map``).

    python scripts/tpu/aot_kernels.py --topology v5e:2x2 --layout one_chip
"""

from __future__ import annotations

import argparse
import json
import os
import time

os.environ.setdefault("TPU_WORKER_HOSTNAMES", "localhost")  # no TPU VM metadata to read

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
from jax.experimental import topologies  # noqa: E402
from jax.sharding import Mesh, NamedSharding  # noqa: E402
from jax.sharding import PartitionSpec as P  # noqa: E402

from pallas_kernels import token_logprobs  # noqa: E402

MOSAIC = "tpu_custom_call"


def compile_logprob_grad(devices, n: int, d: int, v: int, impl: str, dtype=jnp.bfloat16,
                         block_n=None, block_v=None):
    """The compiled gradient program for ``devices`` (a list of topology devices): tokens
    split over them when there are several."""
    mesh = Mesh(devices, ("data",))
    rows, full = NamedSharding(mesh, P("data")), NamedSharding(mesh, P())
    hidden = jax.ShapeDtypeStruct((n, d), dtype, sharding=NamedSharding(mesh, P("data", None)))
    head = jax.ShapeDtypeStruct((d, v), dtype, sharding=full)
    targets = jax.ShapeDtypeStruct((n,), jnp.int32, sharding=rows)

    def loss(h, w, y):
        return jnp.sum(token_logprobs(h, w, y, impl=impl, block_n=block_n, block_v=block_v))

    grad = jax.jit(jax.grad(loss, argnums=(0, 1)),
                   out_shardings=(NamedSharding(mesh, P("data", None)), full))
    with jax.set_mesh(mesh):
        lowered = grad.trace(hidden, head, targets).lower()
    return lowered.compile()


def memory_figures(compiled) -> dict:
    """Per-chip bytes from the compiler, in MiB."""
    mem = compiled.memory_analysis()
    mib = 2.0 ** 20
    return {"argument_mib": round(mem.argument_size_in_bytes / mib, 1),
            "output_mib": round(mem.output_size_in_bytes / mib, 1),
            "temp_mib": round(mem.temp_size_in_bytes / mib, 1),
            "generated_code_mib": round(mem.generated_code_size_in_bytes / mib, 2),
            "mosaic_kernels": compiled.as_text().count(MOSAIC)}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--topology", default="v5e:2x2")
    ap.add_argument("--layout", choices=("one_chip", "mesh"), default="one_chip")
    ap.add_argument("--impls", default="pallas,reference,chunked")
    ap.add_argument("--tokens", type=int, default=2048)
    ap.add_argument("--hidden", type=int, default=896)
    ap.add_argument("--vocab", type=int, default=151_936)
    args = ap.parse_args()
    topology = topologies.get_topology_desc(platform="tpu", topology_name=args.topology)
    devices = topology.devices[:1] if args.layout == "one_chip" else topology.devices
    for impl in args.impls.split(","):
        start = time.perf_counter()
        compiled = compile_logprob_grad(devices, args.tokens, args.hidden, args.vocab, impl)
        print(json.dumps({"program": "token_logprobs_grad", "impl": impl,
                          "topology": args.topology, "layout": args.layout,
                          "chips": len(devices), "device_kind": devices[0].device_kind,
                          "tokens": args.tokens, "hidden": args.hidden, "vocab": args.vocab,
                          "compile_s": round(time.perf_counter() - start, 1),
                          **memory_figures(compiled)}), flush=True)


if __name__ == "__main__":
    main()
