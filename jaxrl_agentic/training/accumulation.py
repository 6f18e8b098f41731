"""Gradient accumulation over the groups of rows of a packed mini-batch.

A mini-batch ``[n_micro, T]`` is scanned in groups of ``data · fsdp`` rows (one per batch
shard of the mesh, :func:`micro_groups`); each group runs on the shortest prefix of its
rows that holds its real tokens (:func:`on_shortest_prefix`), and a group of padding rows
is skipped (under context parallelism, whose rows are laid out in zigzag order, a group
runs on its whole rows: :func:`row_halvings`). :func:`accumulate_gradient_sums` sums
gradients, loss sums and denominators in fp32 (``update.py`` divides once);
:func:`scan_row_groups` runs a per-token function the same way (the logprob and value
passes, ``per_token.py``).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from jax import lax

from jaxrl_agentic.data import prefix_lengths
from jaxrl_agentic.runtime.parallel import (
    batch_sharding,
    constrain_like_params,
    context_size,
    num_batch_shards,
)

_F32 = jnp.float32


# Batch arrays whose last axis is not the row's positions (never cut by a prefix).
_NOT_POSITIONAL = ("loss_index",)


def micro_groups(batch: dict[str, jax.Array], group_rows: int) -> dict[str, jax.Array]:
    """``[n_micro, T]`` → ``[n_micro / group_rows, group_rows, T]``, group ``j`` holding rows
    ``j, j + k, j + 2k, …`` (``k`` = groups): with rows sharded in contiguous blocks over the
    batch axes, every group then has one row on each shard and the reshape moves no data."""
    n_micro = batch["tokens"].shape[0]
    if n_micro % group_rows:
        raise ValueError(
            f"the batch has {n_micro} micro-batch rows, not a multiple of the mesh's "
            f"{group_rows} batch shards (data·fsdp); pad it with data.pad_rows"
        )
    groups = n_micro // group_rows

    def regroup(x):
        return jnp.swapaxes(x.reshape(group_rows, groups, *x.shape[1:]), 0, 1)

    return {k: regroup(v) for k, v in batch.items()}


def ungroup(out: jax.Array) -> jax.Array:
    """Undoes :func:`micro_groups` on a scan's stacked output ``[groups, group_rows, T]``."""
    return jnp.swapaxes(out, 0, 1).reshape(-1, out.shape[-1])


def constrain_rows(micro, mesh):
    """``micro`` constrained to the mesh's batch sharding (identity without a mesh)."""
    if mesh is None:
        return micro
    return lax.with_sharding_constraint(micro, batch_sharding(mesh))


def row_halvings(mesh, halvings: int) -> int:
    """The prefix halvings a group of rows may be cut to on ``mesh``: ``halvings``, or 0
    with a context axis (the model lays each row out in zigzag order over it, where a
    prefix of the packed row is no prefix of the devices' shares)."""
    return halvings if context_size(mesh) == 1 else 0


def used_length(segment_ids: jax.Array) -> jax.Array:
    """1 + the last position at which any row of ``segment_ids [rows, T]`` holds a real
    token (0 when all are padding)."""
    busy = jnp.any(segment_ids > 0, axis=0)
    return jnp.max(jnp.where(busy, jnp.arange(1, busy.shape[0] + 1), 0))


def on_shortest_prefix(fn, empty, micro: dict[str, jax.Array], lengths: tuple[int, ...]):
    """``fn`` on ``micro``'s rows cut to the shortest of ``lengths`` that holds every real
    token, or ``empty(micro)`` when the group is all padding (one ``lax.switch``).

    Exact: positions at and after :func:`used_length` are padding, which attends to nothing,
    is attended by nothing and carries no loss, so cutting them off changes no real token's
    value or gradient. It pays on the last, part-filled group of a mini-batch (first-fit
    leaves one): 13 rows of 1,024 tokens on 2 devices make 7 groups, the 7th holding 158
    tokens, and that group costs a 512-token row instead of a 1,024-token one.
    ``loss_index`` (positions, not a position axis) is passed whole."""
    used = used_length(micro["segment_ids"])
    index = jnp.where(used == 0, 0, 1 + jnp.searchsorted(jnp.asarray(lengths), used))

    def cut(n):
        return lambda m: fn({k: v if k in _NOT_POSITIONAL else v[:, :n] for k, v in m.items()})

    return lax.switch(index, [empty] + [cut(n) for n in lengths], micro)


def scan_row_groups(fn, batch: dict[str, jax.Array], mesh, halvings: int = 0) -> jax.Array:
    """``[n_micro, T]`` per-token outputs of ``fn(micro) -> [group_rows, T']`` over groups of
    ``data · fsdp`` rows, each group run on the shortest prefix of
    :func:`prefix_lengths` ``(T, halvings)`` that holds its real tokens (T' its length; the
    rest is zeros); groups of padding rows give zeros without running ``fn``."""
    row_len = batch["tokens"].shape[-1]
    lengths = prefix_lengths(row_len, row_halvings(mesh, halvings))

    def padded(m):
        out = fn(m)
        return jnp.pad(out.astype(_F32), ((0, 0), (0, row_len - out.shape[-1])))

    def body(_, micro):
        micro = constrain_rows(micro, mesh)
        return None, on_shortest_prefix(
            padded, lambda m: jnp.zeros(m["tokens"].shape, _F32), micro, lengths)

    group_rows = 1 if mesh is None else num_batch_shards(mesh)
    _, out = lax.scan(body, None, micro_groups(batch, group_rows))
    return ungroup(out)


def accumulate_gradients(micro_objective, params, batch, zero_sums, mesh=None,
                         halvings: int = 0):
    """Gradient of ``Σ_micro objective / max(Σ_micro D, 1)`` over a mini-batch, in one scan:
    :func:`accumulate_gradient_sums` divided *once* by the global denominator, in fp32.
    Returns ``(grads, sums, denominator)``."""
    grad_sum, sums, denominator = accumulate_gradient_sums(micro_objective, params, batch,
                                                           zero_sums, mesh, halvings)
    return scale_gradients(grad_sum, 1.0 / jnp.maximum(denominator, 1.0)), sums, denominator


def scale_gradients(grads, scale):
    """``grads · scale`` in fp32."""
    return jax.tree.map(lambda g: g.astype(_F32) * scale, grads)


def accumulate_gradient_sums(micro_objective, params, batch, zero_sums, mesh=None,
                             halvings: int = 0):
    """``(Σ_micro ∇objective, sums, denominator)`` over a mini-batch, in one scan.

    ``micro_objective(params, micro) -> (objective_sum, (sums, denominator))`` is evaluated
    on groups of ``data · fsdp`` rows, each cut to the shortest prefix of
    :func:`prefix_lengths` ``(T, halvings)`` that holds its real tokens
    (:func:`on_shortest_prefix`); gradient sums, loss sums and denominators accumulate
    in fp32. The caller divides by the denominator where the gradient is used
    (:func:`apply_if_finite`), so the division never needs a buffer of its own.

    A mini-batch of a single group is differentiated directly: the scan's fp32 accumulator
    would sit beside that group's own gradient (a second copy of every parameter's
    gradient in the step's temporaries), to add it to zeros.
    """
    group_rows = 1 if mesh is None else num_batch_shards(mesh)
    grad_fn = jax.grad(micro_objective, has_aux=True)
    lengths = prefix_lengths(batch["tokens"].shape[-1], row_halvings(mesh, halvings))
    groups = micro_groups(batch, group_rows)
    if batch["tokens"].shape[0] == group_rows:
        micro = constrain_rows({k: v[0] for k, v in groups.items()}, mesh)
        grads, (sums, denominator) = grad_fn(params, micro)
        return grads, sums, denominator

    def zeros(_):
        return (jax.tree.map(jnp.zeros_like, params),
                (jax.tree.map(jnp.zeros_like, zero_sums), jnp.zeros((), _F32)))

    def body(carry, micro):
        grad_sum, sums_acc, denominator_acc = carry
        micro = constrain_rows(micro, mesh)
        # A group of padding rows adds exactly nothing: skip its forward and backward.
        grads, (sums, denominator) = on_shortest_prefix(
            lambda m: grad_fn(params, m), zeros, micro, lengths)
        grad_sum = jax.tree.map(lambda a, g: a + g.astype(_F32), grad_sum, grads)
        if mesh is not None:
            grad_sum = constrain_like_params(grad_sum, mesh)
        sums_acc = jax.tree.map(jnp.add, sums_acc, sums)
        return (grad_sum, sums_acc, denominator_acc + denominator), None

    init = (
        jax.tree.map(lambda p: jnp.zeros(p.shape, _F32), params),
        zero_sums,
        jnp.zeros((), _F32),
    )
    (grad_sum, sums, denominator), _ = lax.scan(body, init, groups)
    return grad_sum, sums, denominator
