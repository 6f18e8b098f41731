"""A group of packed rows laid out for context parallelism (the mesh's ``context`` axis).

With C > 1 devices on the ``context`` axis, each row's positions are split over them
(``runtime.parallel.context_sharding``). The learner computes every per-token input of the
loss in **prediction index** first, on the rows as packed (targets = next tokens, the
shifted loss mask, advantages, old and reference logprobs, reduction weights and
denominators): the next-token shift and the per-sample reductions then never meet a
split. Only then are the rows laid out:

1. **zigzag** (:func:`zigzag`): every ``[B, T]`` array's columns are permuted by
   ``pallas_kernels.context_attention.zigzag_order``, so that device i holds chunks i and
   2C − 1 − i of each row (equal causal attention work), and sharded ``P(("data", "fsdp"),
   "context")``. The model reads the tokens, positions, segment and prefix ids in that
   order, plus each token's column (``PackedRows.columns``), which is what its attention
   is causal in.
2. **shard rows** (:func:`shard_rows`): ``[B, T, ...] → [B·C, T/C, ...]``, one row per
   (row, context shard), a reshape that moves no data.
3. **loss slots per shard row** (:func:`local_loss_index`): the first ``S' = min(S, T/C)``
   loss positions of each shard row (S: the batch's ``loss_index`` slots, which hold every
   loss position of a row, so a shard row never has more), so the LM head and the loss
   kernels run only where the loss is, on each device's own tokens.

The loss is a sum over tokens: nothing is permuted back, and the sums and the gradient
reduce over the context axis as over the batch axes. Per-token outputs (logprobs) are
scattered back to the packed order (:func:`scatter_to_rows`).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from pallas_kernels.context_attention import zigzag_order
from pallas_kernels.mesh_axes import BATCH_AXES, CONTEXT_AXIS

# The model's inputs that are token arrays of the row.
MODEL_KEYS = ("tokens", "positions", "segment_ids", "prefix_ids")


def traced_context_size() -> int:
    """The context axis' size of the mesh a step is traced under (``update.kernels_see_mesh``);
    1 without a mesh or without the axis."""
    mesh = jax.sharding.get_abstract_mesh()
    if mesh is None or mesh.empty:
        return 1
    return dict(mesh.shape).get(CONTEXT_AXIS, 1)


def _constrain(x, spec):
    mesh = jax.sharding.get_abstract_mesh()
    return jax.lax.with_sharding_constraint(x, NamedSharding(mesh, spec))


def zigzag(x: jax.Array, shards: int) -> jax.Array:
    """``x [B, T, ...]`` with its columns in zigzag order, positions split over context."""
    order = zigzag_order(x.shape[1], shards)
    return _constrain(x[:, order], P(BATCH_AXES, CONTEXT_AXIS))


def shard_rows(x: jax.Array, shards: int) -> jax.Array:
    """``[B, T, ...] → [B·C, T/C, ...]``: row b's shard c is row b·C + c."""
    b, t = x.shape[:2]
    rows = x.reshape(b * shards, t // shards, *x.shape[2:])
    return _constrain(rows, P((*BATCH_AXES, CONTEXT_AXIS)))


def local_loss_index(active: jax.Array, slots: int) -> jax.Array:
    """``[R, slots]`` int32: the positions of the first ``slots`` True entries of each row of
    ``active [R, L]``, ascending, −1 for empty slots."""
    length = active.shape[1]
    key = jnp.where(active, jnp.arange(length), length)  # inactive positions sort last
    index = jnp.sort(key, axis=1)[:, :slots]
    return jnp.where(index < length, index, -1).astype(jnp.int32)


def loss_positions(loss_index: jax.Array, length: int) -> jax.Array:
    """``[B, T]`` bool: True at the batch's loss slots (``PackedBatch.loss_index``)."""
    rows = jnp.arange(loss_index.shape[0])[:, None]
    index = jnp.where(loss_index >= 0, loss_index, length)  # empty slots are dropped
    return jnp.zeros((loss_index.shape[0], length), bool).at[rows, index].set(True, mode="drop")


def forward_at_loss(run, micro: dict[str, jax.Array], shards: int):
    """``(hidden [N, D], head, take, valid [N], index)`` of a group of rows under context
    parallelism (module docstring). ``run(laid_out_micro, columns) -> (hidden, head)`` is the
    model's forward; ``take(x)`` picks a ``[B, T]`` prediction-index array (in packed order)
    at the same ``N = B·C·S'`` slots; ``index [B·C, S']`` are those slots in the shard rows."""
    length = micro["tokens"].shape[1]
    laid = {k: zigzag(micro[k], shards) for k in MODEL_KEYS if micro.get(k) is not None}
    columns = jnp.broadcast_to(jnp.asarray(zigzag_order(length, shards)), micro["tokens"].shape)
    hidden, head = run(laid, _constrain(columns, P(BATCH_AXES, CONTEXT_AXIS)))
    slots = min(micro["loss_index"].shape[1], length // shards)
    active = loss_positions(micro["loss_index"], length)
    index = local_loss_index(shard_rows(zigzag(active, shards), shards), slots)
    safe = jnp.where(index >= 0, index, 0)

    def take_rows(x):  # x [R, T/C, ...] → [R·S', ...]
        picked = jnp.take_along_axis(x, safe.reshape(safe.shape + (1,) * (x.ndim - 2)), axis=1)
        return picked.reshape((-1,) + x.shape[2:])

    def take(x):
        return take_rows(shard_rows(zigzag(x, shards), shards))

    return take_rows(shard_rows(hidden, shards)), head, take, (index >= 0).reshape(-1), index


def scatter_to_rows(values: jax.Array, index: jax.Array, shards: int,
                    length: int) -> jax.Array:
    """``values [R·S']`` at :func:`forward_at_loss`'s slots → ``[R/C, T]`` float32 in packed
    (prediction-index) order, 0 elsewhere."""
    rows, width = index.shape[0], length // shards
    at = jnp.where(index >= 0, index, width)  # empty slots write out of bounds: dropped
    out = jnp.zeros((rows, width), jnp.float32).at[jnp.arange(rows)[:, None], at].set(
        values.reshape(rows, -1).astype(jnp.float32), mode="drop")
    out = out.reshape(rows // shards, length)
    return out[:, np.argsort(zigzag_order(length, shards))]
