"""Run an accelerator kernel once per device, on that device's rows (``jax.shard_map``).

XLA cannot partition a Pallas kernel: a Mosaic (TPU) ``pallas_call`` inside a ``jit`` over
several devices is refused when it is lowered ("Mosaic kernels cannot be automatically
partitioned. Please wrap the call in a shard_map."), and a Triton (GPU) one is given
replicated operands, so every device would compute every row. The learner traces its steps
under ``jax.set_mesh(mesh)``; when that mesh spans more than one device, the kernel
wrappers call the kernel through :func:`per_shard`, with every mesh axis manual, as
Mosaic requires. Their operands are laid out by the learner's mesh convention
(``mesh_axes``, owned by ``jaxrl_agentic.runtime.parallel``): rows over ``BATCH_AXES``, flat
tokens over ``BATCH_AXES`` and ``CONTEXT_AXIS`` (:func:`token_spec`), attention heads over
``HEAD_AXIS``. Without a mesh, or on one device, the kernel is called as it is.

Every kernel using this maps rows to rows (attention, per-token logprobs) or returns
per-shard partial sums that the caller adds up outside (the PPO loss): no collective inside,
so differentiation through the ``shard_map`` needs nothing of its own.
"""

from __future__ import annotations

import math

import jax
from jax.sharding import PartitionSpec as P

from pallas_kernels.mesh_axes import BATCH_AXES, CONTEXT_AXIS, HEAD_AXIS


def use_mesh_for_kernels(mesh):
    """Context manager: ``mesh`` as JAX's abstract mesh while a step is traced (inside
    ``jit``, where ``jax.set_mesh`` is refused), for :func:`kernel_mesh` to find.
    ``jax.sharding.use_abstract_mesh`` is public from JAX 0.8; 0.7 has it only in
    ``jax._src.mesh``."""
    use = getattr(jax.sharding, "use_abstract_mesh", None)
    if use is None:
        from jax._src.mesh import use_abstract_mesh as use
    return use(mesh.abstract_mesh)


def kernel_mesh():
    """The context mesh (``jax.set_mesh``) when it spans more than one device, else None."""
    mesh = jax.sharding.get_abstract_mesh()
    if mesh is None or mesh.empty or math.prod(mesh.shape.values()) == 1:
        return None
    return mesh


def axis_size(mesh, names) -> int:
    """Devices along the mesh axes ``names`` that the mesh has (1 for none)."""
    return math.prod(mesh.shape[n] for n in names if n in mesh.shape)


def batch_spec(mesh, rows: int):
    """The ``PartitionSpec`` entry for a leading axis of ``rows``: split over the mesh's
    batch axes when they divide it, else None (every device then computes every row:
    redundant, still exact)."""
    axes = tuple(a for a in BATCH_AXES if a in mesh.shape)
    return axes if axes and rows % axis_size(mesh, axes) == 0 else None


def token_spec(mesh, tokens: int):
    """The entry for a flat token axis ``[tokens, ...]`` (the logprob and loss kernels'
    inputs): split over the batch axes and the context axis (a row's positions are split
    over it under context parallelism) when they divide it, else :func:`batch_spec`'s."""
    axes = tuple(a for a in (*BATCH_AXES, CONTEXT_AXIS) if a in mesh.shape)
    if CONTEXT_AXIS in axes and mesh.shape[CONTEXT_AXIS] > 1 \
            and tokens % axis_size(mesh, axes) == 0:
        return axes
    return batch_spec(mesh, tokens)


def head_spec(mesh, *heads: int):
    """The entry for a heads axis: split over ``HEAD_AXIS`` when it divides every count."""
    if HEAD_AXIS not in mesh.shape or any(h % mesh.shape[HEAD_AXIS] for h in heads):
        return None
    return HEAD_AXIS


def per_shard(fn, specs):
    """``fn`` under ``jax.shard_map`` over the context mesh when it has more than one device
    (module docstring), else ``fn`` itself. ``specs(mesh) -> (in_specs, out_specs)``, the
    ``PartitionSpec`` trees for that mesh."""
    mesh = kernel_mesh()
    if mesh is None:
        return fn
    in_specs, out_specs = specs(mesh)
    return jax.shard_map(fn, mesh=mesh, in_specs=in_specs, out_specs=out_specs,
                         check_vma=False)


__all__ = ["P", "axis_size", "batch_spec", "head_spec", "kernel_mesh", "per_shard",
           "token_spec", "use_mesh_for_kernels"]
