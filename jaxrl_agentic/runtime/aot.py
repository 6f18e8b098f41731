"""Ahead-of-time compilation for a device topology this machine does not have.

With ``libtpu`` installed, ``jax.experimental.topologies`` describes the chips of a TPU
topology (``"v5e:2x2"``) and XLA's TPU compiler compiles programs for them on a CPU host;
``"cpu:N"`` stands for N host devices (``--xla_force_host_platform_device_count``), which
lets the whole path run where libtpu is missing. For each compiled program
:func:`program_figures` reads the compiler's own per-chip bytes and counts the collectives
in its HLO, and :func:`peak_bytes` turns them into what a chip holds while it runs:

    peak = resident + arguments − (arguments already resident) + outputs − aliased + temp
           + generated code

(``aliased``: outputs written over donated arguments; ``resident``: what stays on the chip
between programs, the train state).

**Traced as on the target.** Some code chooses its path from ``jax.default_backend()``
(which kernels "auto" means, CPU-only bit-matching of bf16 sums): on a CPU host compiling
for a TPU that answer is "cpu", and the program would not be the one a TPU host builds.
:func:`traced_for` answers the target's platform while a program is traced and lowered.
"""

from __future__ import annotations

import contextlib
import dataclasses
import math
import os
import re
from typing import Any

import jax
import numpy as np

# HBM per chip (bytes), by the device kind libtpu reports and by topology name prefix.
GIB = 1024**3
HBM_PER_CHIP = {"v4": 32 * GIB, "v5e": 16 * GIB, "v5litepod": 16 * GIB, "v5p": 95 * GIB,
                "v6e": 32 * GIB}
_KIND_TO_NAME = {"TPU v4": "v4", "TPU v5 lite": "v5e", "TPU v5": "v5p", "TPU v6 lite": "v6e"}
COLLECTIVES = ("all-reduce", "all-gather", "reduce-scatter", "all-to-all",
               "collective-permute")
# An HLO instruction's opcode is followed by its operand list; async pairs count once (start).
_COLLECTIVE_RE = re.compile(r"(?<![\w.%-])(" + "|".join(COLLECTIVES) + r")(-start)?\(")
# XLA:TPU emits a reduce-scatter as a fusion calling an ``%all-reduce-scatter.N``
# computation (an all-reduce inside), and some collectives as asynchronous custom calls.
_REDUCE_SCATTER_FUSION = "calls=%all-reduce-scatter"
_ASYNC_CUSTOM_CALL = 'custom_call_target="AsyncCollectiveStart"'
INSTALL_HINT = ("libtpu is not installed: compiling for a TPU topology needs it, in an "
                "environment of its own (python -m venv /opt/tpuvenv && /opt/tpuvenv/bin/pip "
                "install \"jax[tpu]==" + jax.__version__ + "\" && /opt/tpuvenv/bin/pip "
                "install -e . --no-deps; docs/tpu.md, \"Compile for a TPU without one\"), "
                "or use --topology cpu:N")


class CompilerUnavailable(RuntimeError):
    """No compiler for the topology here (libtpu missing): :data:`INSTALL_HINT`."""


@dataclasses.dataclass(frozen=True)
class Topology:
    """The devices of a topology and what one of them holds."""

    name: str
    platform: str  # "tpu" or "cpu"
    devices: tuple[Any, ...]
    hbm_bytes: float  # per chip (0 = unknown)

    @property
    def chips(self) -> int:
        return len(self.devices)


def topology(name: str) -> Topology:
    """``"v5e:2x2"``-style TPU topologies (needs libtpu: :class:`CompilerUnavailable`
    otherwise) or ``"cpu:N"``, the first N CPU devices of this process."""
    if name.startswith("cpu:"):
        count = int(name.split(":", 1)[1])
        devices = jax.devices("cpu")
        if len(devices) < count:
            raise ValueError(f"--topology {name}: this process has {len(devices)} CPU devices "
                             f"(set XLA_FLAGS=--xla_force_host_platform_device_count={count} "
                             "before JAX starts)")
        ram = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
        return Topology(name, "cpu", tuple(devices[:count]), ram / count)
    from jax.experimental import topologies

    os.environ.setdefault("TPU_WORKER_HOSTNAMES", "localhost")  # no TPU VM metadata here
    try:
        desc = topologies.get_topology_desc(platform="tpu", topology_name=name)
    except RuntimeError as e:
        if "not installed" in str(e):
            raise CompilerUnavailable(INSTALL_HINT) from None
        raise ValueError(f"--topology {name}: {str(e).splitlines()[0]}") from None
    devices = tuple(desc.devices)
    kind = _KIND_TO_NAME.get(devices[0].device_kind, name.split(":", 1)[0])
    return Topology(name, "tpu", devices, float(HBM_PER_CHIP.get(kind, 0)))


@contextlib.contextmanager
def traced_for(platform: str):
    """``jax.default_backend()`` answers ``platform`` inside (module doc); nothing else
    changes: JAX's own lowering asks its backends, not this function."""
    if platform == jax.default_backend():
        yield
        return
    real = jax.default_backend
    jax.default_backend = lambda: platform
    try:
        yield
    finally:
        jax.default_backend = real


def _itemsize(dtype) -> int:
    """Bytes of one value (a PRNG key's dtype by its key data: two uint32 for threefry)."""
    if jax.dtypes.issubdtype(dtype, jax.dtypes.prng_key):
        return 8
    return np.dtype(dtype).itemsize


def shard_bytes(tree: Any) -> float:
    """Bytes one device holds of a pytree of arrays or ``ShapeDtypeStruct``s with
    shardings (the largest shard of each leaf: uneven splits round up)."""
    total = 0
    for leaf in jax.tree.leaves(tree):
        shape = leaf.sharding.shard_shape(leaf.shape) if leaf.sharding is not None else leaf.shape
        total += math.prod(shape) * _itemsize(leaf.dtype)
    return float(total)


def global_bytes(tree: Any) -> float:
    return float(sum(math.prod(x.shape) * _itemsize(x.dtype)
                     for x in jax.tree.leaves(tree)))


def abstract(tree: Any, shardings: Any) -> Any:
    """``ShapeDtypeStruct``s of ``tree``'s leaves (arrays or structs) with ``shardings``."""
    return jax.tree.map(lambda x, s: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=s),
                        tree, shardings)


def collective_counts(hlo_text: str) -> dict[str, int]:
    """Collective instructions of a compiled HLO module, by opcode: an async
    ``*-start``/``*-done`` pair counted once, XLA:TPU's reduce-scatter fusions as
    reduce-scatters (not the all-reduce inside them), and its asynchronous collective custom
    calls apart (``async_custom_calls``)."""
    counts = dict.fromkeys(COLLECTIVES, 0)
    counts["async_custom_calls"] = 0
    inside_fusion_body = False
    for line in hlo_text.splitlines():
        if line[:1] not in ("", " ") and line.rstrip().endswith("{"):  # a computation starts
            inside_fusion_body = line.startswith("%all-reduce-scatter")
            continue
        if _REDUCE_SCATTER_FUSION in line:
            counts["reduce-scatter"] += 1
            continue
        if _ASYNC_CUSTOM_CALL in line:
            counts["async_custom_calls"] += 1
            continue
        if inside_fusion_body:
            continue
        for match in _COLLECTIVE_RE.finditer(line):
            counts[match.group(1)] += 1
    return counts


def program_figures(compiled) -> dict[str, Any]:
    """The compiler's per-chip bytes of ``compiled`` and its collectives."""
    mem = compiled.memory_analysis()
    return {"argument_bytes": int(mem.argument_size_in_bytes),
            "output_bytes": int(mem.output_size_in_bytes),
            "alias_bytes": int(mem.alias_size_in_bytes),
            "temp_bytes": int(mem.temp_size_in_bytes),
            "generated_code_bytes": int(mem.generated_code_size_in_bytes),
            "collectives": collective_counts(compiled.as_text())}


def peak_bytes(figures: dict[str, Any], resident: float = 0.0,
               resident_arguments: float = 0.0) -> float:
    """What one chip holds while the program runs (module doc's formula)."""
    return (resident + figures["argument_bytes"] - resident_arguments
            + figures["output_bytes"] - figures["alias_bytes"] + figures["temp_bytes"]
            + figures["generated_code_bytes"])


def compile_abstract(fn, *args, platform: str):
    """``fn`` (jitted) lowered for ``args`` (``ShapeDtypeStruct``s with shardings) and
    compiled, traced as on ``platform`` (:func:`traced_for`)."""
    with traced_for(platform):
        lowered = fn.trace(*args).lower()
    return lowered.compile()


__all__ = ["COLLECTIVES", "CompilerUnavailable", "GIB", "HBM_PER_CHIP", "INSTALL_HINT",
           "Topology", "abstract", "collective_counts", "compile_abstract", "global_bytes",
           "peak_bytes", "program_figures", "shard_bytes", "topology", "traced_for"]
