"""Device mesh and sharding rules: one code path for 1 CPU, 1 GPU and a TPU pod.

The mesh has three axes, ``("data", "fsdp", "tensor")``:

* ``data``   — batch rows are split over it; parameters are replicated.
* ``fsdp``   — batch rows are split over it *and* parameters are stored sharded over it
  (their hidden dimension ``D``); XLA all-gathers a weight for the matmul and
  reduce-scatters its gradient (ZeRO-3).
* ``tensor`` — Megatron-style model parallelism: attention heads (q/k/v output columns,
  o_proj input rows) and MLP width (gate/up output columns, down_proj input rows) are split
  over it, as is the vocabulary of the embedding / lm head.

So a batch is sharded ``P(("data", "fsdp"), None)`` (rows over ``data × fsdp``) and each
parameter gets a ``PartitionSpec`` from its *name* (:func:`param_partition_spec`). A dimension
that its mesh axis does not divide evenly stays unsharded (replication is always correct;
it only costs memory). Everything else (norm scales, counters, scalars) is replicated.

The rules look at the last module/parameter names in a pytree path, so the same function
places the parameters, the reference parameters and the optimizer moments (whose paths end
in the parameter's path) — see :func:`train_state_shardings`.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from typing import Any

import jax
import numpy as np
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

MESH_AXES = ("data", "fsdp", "tensor")
BATCH_AXES = ("data", "fsdp")

# (module name, parameter name) → mesh axis of each dimension. Kernels are [in, out]
# (flax Linear), the embedding is [V, D].
_COLUMN_PARALLEL = ("fsdp", "tensor")  # [D, heads·head_dim] or [D, F]: split the outputs
_ROW_PARALLEL = ("tensor", "fsdp")  # [heads·head_dim, D] or [F, D]: split the inputs
_PARAM_RULES: dict[tuple[str, str], tuple[str | None, ...]] = {
    ("embed", "embedding"): ("tensor", "fsdp"),
    ("lm_head", "kernel"): ("fsdp", "tensor"),
    **{(name, "kernel"): _COLUMN_PARALLEL for name in ("q_proj", "k_proj", "v_proj")},
    **{(name, "kernel"): _COLUMN_PARALLEL for name in ("gate_proj", "up_proj")},
    ("o_proj", "kernel"): _ROW_PARALLEL,
    ("down_proj", "kernel"): _ROW_PARALLEL,
    # Biases follow the output dimension of their matmul.
    **{(name, "bias"): ("tensor",) for name in ("q_proj", "k_proj", "v_proj")},
    **{(name, "bias"): ("tensor",) for name in ("gate_proj", "up_proj")},
    ("o_proj", "bias"): ("fsdp",),
    ("down_proj", "bias"): ("fsdp",),
}


def make_mesh(
    data: int = -1, fsdp: int = 1, tensor: int = 1, devices: Sequence[Any] | None = None
) -> Mesh:
    """A ``("data", "fsdp", "tensor")`` mesh over ``devices`` (default: all devices).

    One axis may be −1: it takes whatever the others leave. The product must equal the
    number of devices. ``tensor`` is the fastest-varying axis so that on real hardware its
    (communication-heavy) groups are neighbouring devices.
    """
    devices = list(jax.devices() if devices is None else devices)
    sizes = [data, fsdp, tensor]
    if sizes.count(-1) > 1 or any(s == 0 or s < -1 for s in sizes):
        raise ValueError(f"mesh axes must be positive, at most one -1; got {sizes}")
    known = math.prod(s for s in sizes if s != -1)
    if -1 in sizes:
        if len(devices) % known:
            raise ValueError(f"{len(devices)} devices are not divisible by {known} ({sizes})")
        sizes[sizes.index(-1)] = len(devices) // known
    if math.prod(sizes) != len(devices):
        raise ValueError(
            f"mesh {dict(zip(MESH_AXES, sizes, strict=True))} needs {math.prod(sizes)} "
            f"devices, got {len(devices)}"
        )
    return Mesh(np.asarray(devices, dtype=object).reshape(sizes), MESH_AXES)


def _path_names(path: Sequence[Any]) -> list[str]:
    """String names along a pytree key path (dict keys, attribute names); indices dropped."""
    names = []
    for entry in path:
        key = getattr(entry, "key", getattr(entry, "name", None))
        if isinstance(key, str):
            names.append(key)
    return names


def param_partition_spec(
    path: Sequence[Any], shape: Sequence[int], mesh_shape: Mapping[str, int] | None = None
) -> P:
    """``PartitionSpec`` of the array at ``path`` (a pytree key path or a tuple of names).

    Matches the last ``(module, parameter)`` name pair of the path against the rules in the
    module docstring; unknown names and scalars are replicated. With ``mesh_shape`` (axis →
    size, e.g. ``mesh.shape``), a dimension its axis does not divide is left unsharded.
    """
    names = [p for p in path if isinstance(p, str)] or _path_names(path)
    names = [n for n in names if n != "value"]  # nnx.Variable's own attribute
    rule = _PARAM_RULES.get(tuple(names[-2:])) if len(names) >= 2 else None
    if rule is None or len(rule) != len(shape):
        return P()
    spec = []
    for dim, axis in zip(shape, rule, strict=True):
        size = 1 if mesh_shape is None or axis is None else mesh_shape[axis]
        spec.append(axis if axis is not None and dim % size == 0 else None)
    return P(*spec)


def _sharding_tree(tree: Any, mesh: Mesh) -> Any:
    def sharding(path, leaf):
        return NamedSharding(mesh, param_partition_spec(path, np.shape(leaf), mesh.shape))

    return jax.tree_util.tree_map_with_path(sharding, tree)


def param_shardings(params: Any, mesh: Mesh) -> Any:
    """Pytree of ``NamedSharding`` matching ``params`` (by the rules above)."""
    return _sharding_tree(params, mesh)


def shard_params(params: Any, mesh: Mesh) -> Any:
    """``params`` placed on ``mesh`` with :func:`param_shardings`."""
    return jax.device_put(params, param_shardings(params, mesh))


def train_state_shardings(state: Any, mesh: Mesh) -> Any:
    """Shardings for a whole train state: parameters, reference parameters and optimizer
    moments by the parameter rules (the moments' paths end in the parameter names);
    counters, keys and scalars replicated."""
    return _sharding_tree(state, mesh)


def replicated(mesh: Mesh) -> NamedSharding:
    return NamedSharding(mesh, P())


def batch_sharding(mesh: Mesh) -> NamedSharding:
    """``[rows, row_len]`` arrays: rows over ``data × fsdp``, tokens of a row together."""
    return NamedSharding(mesh, P(BATCH_AXES, None))


def num_batch_shards(mesh: Mesh) -> int:
    """How many ways batch rows are split (``data · fsdp``); row counts must divide by it."""
    return math.prod(mesh.shape[a] for a in BATCH_AXES)


def constrain_like_params(tree: Any, mesh: Mesh) -> Any:
    """``with_sharding_constraint`` of a params-shaped pytree (e.g. accumulated gradients)
    to the parameter shardings, inside ``jit``: under fsdp the gradient sums then stay
    reduce-scattered instead of being replicated on every device."""
    return jax.lax.with_sharding_constraint(tree, _sharding_tree(tree, mesh))
