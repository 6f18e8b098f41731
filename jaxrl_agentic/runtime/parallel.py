"""Device mesh and sharding rules: one code path for 1 CPU, 1 GPU and a TPU pod.

The mesh has four axes, ``("data", "fsdp", "tensor", "context")``:

* ``data``   — batch rows are split over it; parameters are replicated.
* ``fsdp``   — batch rows are split over it *and* parameters are stored sharded over it
  (their hidden dimension ``D``); XLA all-gathers a weight for the matmul and
  reduce-scatters its gradient (ZeRO-3).
* ``tensor`` — Megatron-style model parallelism: attention heads (q/k/v output columns,
  o_proj input rows) and MLP width (gate/up output columns, down_proj input rows) are split
  over it, as is the vocabulary of the embedding / lm head.
* ``context`` — context parallelism (default size 1): the positions of each packed row are
  split over it (``P(("data", "fsdp"), "context")``), so a device holds the activations of
  ``T / context`` of a row's tokens; parameters are replicated along it and their gradient
  is summed over it by XLA like the data axis'. Attention over a split row all-gathers keys
  and values (``pallas_kernels.context_attention``); the learner lays rows out for it
  (``training/context_rows.py``).

So a batch is sharded ``P(("data", "fsdp"), None)`` (rows over ``data × fsdp``) and each
parameter gets a ``PartitionSpec`` from its *name* (:func:`param_partition_spec`). A dimension
that its mesh axis does not divide evenly stays unsharded (replication is always correct;
it only costs memory). Everything else (norm scales, counters, scalars) is replicated.

The rules look at the last module/parameter names in a pytree path, so the same function
places the parameters, the reference parameters and the optimizer moments (whose paths end
in the parameter's path) — see :func:`train_state_shardings`. The decoder blocks' weights
are stored stacked (``Transformer.layers``: a leading layer axis ``[L, ...]``), which stays
unsharded: every device holds its share of every layer.
"""

from __future__ import annotations

import math
import os
from collections.abc import Mapping, Sequence
from typing import Any

import jax
import numpy as np
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

# The mesh convention is this module's; its names are defined with the kernels, which split
# their operands by them and import only jax (rows over BATCH_AXES, heads over HEAD_AXIS).
from pallas_kernels.mesh_axes import BATCH_AXES, CONTEXT_AXIS, HEAD_AXIS

MESH_AXES = (*BATCH_AXES, HEAD_AXIS, CONTEXT_AXIS)
STACKED_LAYERS = "layers"  # the module whose weights carry a leading layer axis

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
    data: int = -1, fsdp: int = 1, tensor: int = 1, devices: Sequence[Any] | None = None,
    context: int = 1,
) -> Mesh:
    """A ``("data", "fsdp", "tensor", "context")`` mesh over ``devices`` (default: all).

    One axis may be −1: it takes whatever the others leave. The product must equal the
    number of devices. ``tensor`` and ``context`` vary fastest so that on real hardware
    their (communication-heavy: every layer) groups are neighbouring devices.
    """
    devices = list(jax.devices() if devices is None else devices)
    sizes = [data, fsdp, tensor, context]
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


def _names(path: Sequence[Any]) -> list[str]:
    """The names of a pytree key path or of a tuple of names, without nnx's ``value``."""
    names = [p for p in path if isinstance(p, str)] or _path_names(path)
    return [n for n in names if n != "value"]  # nnx.Variable's own attribute


def stacked_layer_dims(path: Sequence[Any]) -> int:
    """1 if the array at ``path`` (a pytree key path or a tuple of names) is a decoder-block
    weight, stored with a leading layer axis (``Transformer.layers``), else 0."""
    return int(STACKED_LAYERS in _names(path))


def param_partition_spec(
    path: Sequence[Any], shape: Sequence[int], mesh_shape: Mapping[str, int] | None = None
) -> P:
    """``PartitionSpec`` of the array at ``path`` (a pytree key path or a tuple of names).

    Matches the last ``(module, parameter)`` name pair of the path against the rules in the
    module docstring; unknown names and scalars are replicated. With ``mesh_shape`` (axis →
    size, e.g. ``mesh.shape``), a dimension its axis does not divide is left unsharded.
    """
    names = _names(path)
    rule = _PARAM_RULES.get(tuple(names[-2:])) if len(names) >= 2 else None
    if rule is not None and STACKED_LAYERS in names:
        rule = (None, *rule)
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


def context_sharding(mesh: Mesh) -> NamedSharding:
    """``[rows, row_len]`` token arrays under context parallelism: rows over
    ``data × fsdp``, each row's positions over ``context``."""
    return NamedSharding(mesh, P(BATCH_AXES, CONTEXT_AXIS))


def context_size(mesh: Mesh | None) -> int:
    """How many ways each row's positions are split (the ``context`` axis; 1 without one)."""
    return 1 if mesh is None else dict(mesh.shape).get(CONTEXT_AXIS, 1)


def num_batch_shards(mesh: Mesh) -> int:
    """How many ways batch rows are split (``data · fsdp``); row counts must divide by it."""
    return math.prod(mesh.shape[a] for a in BATCH_AXES)


def constrain_like_params(tree: Any, mesh: Mesh) -> Any:
    """``with_sharding_constraint`` of a params-shaped pytree (e.g. accumulated gradients)
    to the parameter shardings, inside ``jit``: under fsdp the gradient sums then stay
    reduce-scattered instead of being replicated on every device."""
    return jax.lax.with_sharding_constraint(tree, _sharding_tree(tree, mesh))


def kv_cache_sharding(mesh: Mesh, shape: Sequence[int]) -> NamedSharding:
    """``[rows, kv_heads, slots, head_dim]`` cache arrays: rows over ``data × fsdp`` (each
    device decodes its own streams), kv heads over ``tensor`` (as the k/v projections
    produce them). An axis that does not divide its dimension is left unsharded."""
    rows, heads = shape[0], shape[1]
    row_axes = BATCH_AXES if rows % num_batch_shards(mesh) == 0 else None
    head_axis = "tensor" if heads % mesh.shape["tensor"] == 0 else None
    return NamedSharding(mesh, P(row_axes, head_axis, None, None))


def rows_sharding(mesh: Mesh, rows: int) -> NamedSharding:
    """``[rows, ...]`` sampler inputs (any rank): rows over ``data × fsdp`` when they
    divide, else replicated."""
    if rows % num_batch_shards(mesh):
        return replicated(mesh)
    return NamedSharding(mesh, P(BATCH_AXES))


# ---- several processes (jax.distributed) ---------------------------------------------------


def initialize_distributed(coordinator_address: str = "", num_processes: int = 0,
                           process_id: int = -1) -> None:
    """``jax.distributed.initialize`` for a multi-controller run (one process per host).

    Empty/0/−1 arguments are left to JAX's auto-detection (Cloud TPU VMs, SLURM, …). Must run
    before anything touches the JAX backend (creating an array, listing devices, importing
    gymnax). CPU processes exchange collectives through gloo.
    """
    if jax.distributed.is_initialized():
        return
    jax.config.update("jax_cpu_collectives_implementation", "gloo")
    kwargs: dict[str, Any] = {}
    if coordinator_address:
        kwargs["coordinator_address"] = coordinator_address
    if num_processes > 0:
        kwargs["num_processes"] = num_processes
    if process_id >= 0:
        kwargs["process_id"] = process_id
    jax.distributed.initialize(**kwargs)


def use_cpu_devices(count: int, log=print) -> int:
    """Splits this process' CPU into ``count`` JAX devices (0 = one per core it may run on;
    1 = one device, JAX's default) and returns the count it asked for. Must run before
    anything touches the JAX backend; no effect on GPU/TPU devices.

    Why: one XLA:CPU program keeps about one core busy at a small model's shapes (its
    matmuls are too small for the intra-op thread pool to split well), while devices run
    their shards of a program side by side. With the batch rows split over one device per
    core (the ``data`` axis, as on GPUs), a tiny model's learner step spreads over the cores
    (``docs/benchmarks.md``, "One CPU device per core"). Parameters are replicated per
    device, so a large model on CPU should keep 1 (or shard with ``fsdp``).

    A count that cannot be applied any more (the backend already started, e.g. a second
    run in one process, or ``XLA_FLAGS`` already forces a device count) is logged, and the
    devices JAX has are used.
    """
    from jax._src import xla_bridge  # backends_are_initialized has no public name

    if count < 0:
        raise ValueError(f"cpu_devices must be >= 0, got {count}")
    wanted = count or len(os.sched_getaffinity(0))
    if "xla_force_host_platform_device_count" in os.environ.get("XLA_FLAGS", ""):
        if wanted != 1:
            log(f"cpu_devices={count} not applied: XLA_FLAGS already sets "
                f"--xla_force_host_platform_device_count")
        return wanted
    if xla_bridge.backends_are_initialized():
        have = len(jax.devices("cpu"))
        if have != wanted:
            log(f"cpu_devices={count} not applied: the JAX backend is already running with "
                f"{have} CPU device(s), which this run uses")
        return wanted
    jax.config.update("jax_num_cpu_devices", wanted)
    return wanted


def process_share(n: int) -> tuple[int, int]:
    """``[start, stop)`` of this process's contiguous share of ``n`` items."""
    index, count = jax.process_index(), jax.process_count()
    return index * n // count, (index + 1) * n // count


def allgather_objects(obj: Any) -> list[Any]:
    """Every process's ``obj`` (picklable), in process order, on every process."""
    if jax.process_count() == 1:
        return [obj]
    import pickle

    from jax.experimental import multihost_utils

    data = np.frombuffer(pickle.dumps(obj), np.uint8)
    sizes = np.asarray(multihost_utils.process_allgather(np.array([data.size], np.int32)))
    sizes = sizes.reshape(-1)
    buffer = np.zeros(int(sizes.max()), np.uint8)
    buffer[: data.size] = data
    gathered = np.asarray(multihost_utils.process_allgather(buffer))
    return [pickle.loads(gathered[i, : sizes[i]].tobytes()) for i in range(len(sizes))]


def _local_row_range(sharding: NamedSharding, shape: Sequence[int]) -> tuple[int, int]:
    """Rows of a ``[rows, ...]`` global array held by this process's devices (contiguous:
    devices are ordered by process, so data × fsdp shards of a process are neighbours)."""
    spans = set()
    for index in sharding.addressable_devices_indices_map(tuple(shape)).values():
        start, stop, _ = index[0].indices(shape[0])
        spans.add((start, stop))
    start, stop = min(s for s, _ in spans), max(e for _, e in spans)
    if sum(e - s for s, e in spans) != stop - start and len(spans) > 1:
        raise ValueError(f"this process's rows are not contiguous: {sorted(spans)}")
    return start, stop


def put_rows(arrays: Mapping[str, np.ndarray], mesh: Mesh) -> dict[str, jax.Array]:
    """Host ``[rows, ...]`` arrays (the same on every process) → global arrays sharded
    with :func:`batch_sharding`. With several processes each contributes only the rows its
    own devices hold (``make_array_from_process_local_data``): nothing crosses hosts."""
    sharding = batch_sharding(mesh)
    if jax.process_count() == 1:
        return jax.device_put(dict(arrays), sharding)
    out = {}
    for name, array in arrays.items():
        start, stop = _local_row_range(sharding, array.shape)
        out[name] = jax.make_array_from_process_local_data(sharding, array[start:stop],
                                                           array.shape)
    return out


def place(tree: Any, shardings: Any) -> Any:
    """``jax.device_put(tree, shardings)`` that also works when the shardings span several
    processes: each process then builds only its own shards from its (identical) host copy
    of every leaf (``make_array_from_callback``). PRNG key leaves go through their data."""
    if jax.process_count() == 1:
        return jax.device_put(tree, shardings)

    def put(leaf, sharding):
        if isinstance(leaf, jax.Array) and jax.dtypes.issubdtype(leaf.dtype,
                                                                 jax.dtypes.prng_key):
            data = put(jax.random.key_data(leaf), sharding)
            return jax.random.wrap_key_data(data, impl=jax.random.key_impl(leaf))
        if isinstance(leaf, jax.Array) and leaf.sharding == sharding:
            return leaf
        host = np.asarray(leaf)
        return jax.make_array_from_callback(host.shape, sharding, lambda index: host[index])

    return jax.tree.map(put, tree, shardings)


def to_host(x: jax.Array) -> np.ndarray:
    """The whole value of a (possibly multi-process) array as numpy, on every process."""
    if x.is_fully_addressable or x.is_fully_replicated:
        return np.asarray(x)
    from jax.experimental import multihost_utils

    return np.asarray(multihost_utils.process_allgather(x, tiled=True))


class SamplerPlacement:
    """Where the sampler's copy of the policy lives, and how it is refreshed.

    * One process, no reserved devices: **colocated** — the sampler reads the learner's
      sharded params in place (no copy) and its KV cache is sharded on the same mesh.
    * ``sampler_devices = k > 0``: each process's last ``k`` local devices belong to the
      sampler; the learner's mesh is built from the others. After each update the params
      are resharded onto the sampler's devices (replicated there; streams split over them).
    * Several processes: every process samples its own episodes independently (no
      lock-step generation across hosts), so its sampler holds a process-local replica:
      the params are all-gathered once per refresh and placed on its local devices.
    """

    def __init__(self, sampler_devices: int = 0, learner_devices: Sequence[Any] | None = None):
        per_process = len(jax.local_devices())
        if sampler_devices < 0 or (sampler_devices and sampler_devices >= per_process):
            raise ValueError(
                f"mesh.sampler_devices={sampler_devices}: must be 0 (colocated) or leave "
                f"the learner at least one of each process's {per_process} devices")
        # Every process reserves its own last `sampler_devices` devices.
        self.learner_devices = [d for d in jax.devices()
                                if _local_rank(d) < _num_local(d) - sampler_devices]
        own = [d for d in jax.local_devices() if d not in self.learner_devices]
        if learner_devices is not None:  # an explicit subset (tests compare meshes)
            self.learner_devices = list(learner_devices)
        self.colocated = sampler_devices == 0 and jax.process_count() == 1
        self.mesh = None if self.colocated else make_mesh(devices=own or jax.local_devices())
        self._gather = None

    def params_for_sampler(self, params: Any, learner_mesh: Mesh) -> Any:
        """``params`` (on the learner's mesh) as the sampler should read them."""
        if self.colocated:
            return params
        target = replicated(self.mesh)
        if jax.process_count() == 1:
            return jax.device_put(params, target)
        if self._gather is None:  # jit once: an all-gather of every parameter
            self._gather = jax.jit(lambda tree: tree, out_shardings=replicated(learner_mesh))
        full = self._gather(params)
        return jax.tree.map(lambda x: jax.device_put(x.addressable_data(0), target), full)


def _local_rank(device) -> int:
    """Position of ``device`` among its own process's devices (ordered by id)."""
    same = sorted(d.id for d in jax.devices() if d.process_index == device.process_index)
    return same.index(device.id)


def _num_local(device) -> int:
    return sum(d.process_index == device.process_index for d in jax.devices())
