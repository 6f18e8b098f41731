"""The learner: train state, the jitted train step, and the host loop of one pipeline step.

One ``train_step(state, batch, lr)`` = one optimizer update on one mini-batch, given as
``[n_micro, row_len]`` arrays (a :class:`~jaxrl_agentic.data.PackedBatch`'s token arrays):

    for each group of micro-batch rows (lax.scan):              # fp32 accumulators
        h          = model.hidden_states(tokens, positions, segment_ids)
        sums, D_m  = policy_loss(h, W, next tokens, ...), reduction denominator
        G         += ∇_θ sums.objective;   S += sums;   D += D_m
    g = G / max(D, 1)                                           # the one division
    g = clip_by_global_norm(g, max_grad_norm);  θ ← AdamW(θ, g, lr)

so the update equals the one computed on the whole mini-batch at once, however the packer
split it into micro-batches. A scan step takes ``data · fsdp`` rows at once (one per batch
shard of the mesh), so ``n_micro`` must be a multiple of that.

**Next-token alignment.** ``old_logprobs[t]``, ``loss_mask[t]``, ``advantages[t]`` describe
token ``t``; its logprob comes from the hidden state at ``t − 1``. The step therefore shifts
the per-token arrays one place left ("prediction index" ``i`` = hidden ``i`` predicting
token ``i + 1``) and keeps prediction ``i`` only where tokens ``i`` and ``i + 1`` lie in the
same segment. That masks the last token of every segment (its "next token" belongs to the
next packed sample or is padding) and, equivalently, the first token of every segment
(nothing precedes it, so it can never be trained on).

**Non-finite guard.** If the loss or the gradient norm is NaN/inf the update is skipped:
parameters and optimizer state are returned unchanged and ``metrics["nonfinite"] = 1``.

**Reference policy.** ``TrainState.ref_params`` is a frozen copy of the initial parameters,
kept only when the KL coefficient can be non-zero; it feeds :func:`make_compute_logprobs`.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from typing import Any

import flax.struct
import jax
import jax.numpy as jnp
import numpy as np
import optax
from flax import nnx
from jax import lax

from jaxrl_agentic.algos.kl import (
    KL_ESTIMATORS,
    KLControllerState,
    init_kl_controller,
    update_kl_controller,
)
from jaxrl_agentic.algos.losses import KERNEL_IMPLS, PolicyLossSums, policy_loss
from jaxrl_agentic.algos.reductions import REDUCTIONS, loss_denominator, loss_weights
from jaxrl_agentic.algos.schedules import LR_SCHEDULER_TYPES, make_progress_lr_schedule
from jaxrl_agentic.data import (
    PackedBatch,
    Sample,
    bucket_rows,
    pack_minibatches,
    pack_samples,
    pad_rows,
    round_up_to_bucket,
    split_minibatches,
    token_stats,
    updates_per_step,
)
from jaxrl_agentic.parallel import (
    batch_sharding,
    constrain_like_params,
    make_mesh,
    num_batch_shards,
    place,
    put_rows,
    replicated,
    to_host,
    train_state_shardings,
)
from pallas_kernels import token_logprobs

_F32 = jnp.float32
# Arrays of a PackedBatch the train step reads (ref_logprobs only when a reference is used).
TRAIN_BATCH_KEYS = (
    "tokens",
    "positions",
    "segment_ids",
    "loss_mask",
    "advantages",
    "old_logprobs",
)
LOGPROB_BATCH_KEYS = ("tokens", "positions", "segment_ids")


@dataclasses.dataclass(frozen=True)
class LearnerConfig:
    """Optimizer, loss and packing settings of the learner.

    Loss: ``pg_clip`` / ``pg_clip_high`` are ε_lo / ε_hi (None = symmetric), ``dual_clip`` the
    dual-clip bound c (None = off), ``loss_reduction`` one of ``REDUCTIONS``. KL:
    ``init_kl_coef`` β₀, ``target_kl`` (None = fixed β, else the adaptive controller with
    ``kl_horizon``), ``kl_estimator`` k1/k2/k3, ``kl_in_reward`` (penalise rewards instead of
    the loss: the loss then carries no KL term, the reported KL is still measured).
    ``recompute_old_logprobs``: replace the sampler's logprobs by the learner's at the start
    of each pipeline step. ``tis_imp_ratio_cap`` C (0 = off, needs recompute): truncated
    importance sampling of the off-policy gap between the behaviour (sampler) policy μ and
    the recomputed old policy π_old, w_t = min(π_old(y_t)/μ(y_t), C), detached, multiplies
    each token's policy loss. As w_t ≥ 0 it is applied to the advantage: for PPO's
    max(−A·r, −A·clip(r)) (and the dual clip), w·loss(A) = loss(w·A).
    ``kernel_impl``: ``token_logprobs`` implementation.
    Packing: rows of ``micro_batch_max_tokens``, samples cut to ``sequence_length``, row
    counts bucketed by ``rows_bucket`` (0 = powers of two). ``fixed_rows``: every
    mini-batch is packed to the most rows it can need (``mini_batch_size``: each sample fits
    one row), so the train step's shape never changes with episode lengths and a run
    compiles it once; all-padding rows are skipped inside the scan (``lax.cond``), so they
    cost no compute.
    """

    learning_rate: float = 1e-6
    lr_scheduler_type: str = "constant"
    warmup_steps: int = 0
    min_lr_ratio: float = 0.0
    weight_decay: float = 0.0
    max_grad_norm: float | None = 1.0
    mini_batch_size: int = 8
    ppo_epochs: int = 1
    loss_reduction: str = "token_mean"
    pg_clip: float = 0.2
    pg_clip_high: float | None = None
    dual_clip: float | None = None
    init_kl_coef: float = 0.0
    target_kl: float | None = None
    kl_horizon: float = 10000.0
    kl_estimator: str = "k3"
    kl_in_reward: bool = False
    entropy_loss_coef: float = 0.0
    temperature: float = 1.0
    recompute_old_logprobs: bool = False
    tis_imp_ratio_cap: float = 0.0
    kernel_impl: str = "auto"
    micro_batch_max_tokens: int = 4096
    sequence_length: int = 4096
    rows_bucket: int = 0
    fixed_rows: bool = False
    pad_token_id: int = 0
    adam_b1: float = 0.9
    adam_b2: float = 0.999
    adam_eps: float = 1e-8
    seed: int = 0

    def __post_init__(self):
        checks = [
            (self.loss_reduction in REDUCTIONS, f"loss_reduction must be one of {REDUCTIONS}"),
            (self.kernel_impl in KERNEL_IMPLS, f"kernel_impl must be one of {KERNEL_IMPLS}"),
            (self.kl_estimator in KL_ESTIMATORS, f"kl_estimator must be one of {KL_ESTIMATORS}"),
            (
                self.lr_scheduler_type in LR_SCHEDULER_TYPES,
                f"lr_scheduler_type must be one of {LR_SCHEDULER_TYPES}",
            ),
            (0 < self.pg_clip < 1, "pg_clip must lie in (0, 1)"),
            (self.pg_clip_high is None or self.pg_clip_high > 0, "pg_clip_high must be > 0"),
            (self.dual_clip is None or self.dual_clip > 1, "dual_clip must be > 1"),
            (self.init_kl_coef >= 0, "init_kl_coef must be >= 0"),
            (
                self.target_kl is None or (self.target_kl > 0 and self.init_kl_coef > 0),
                "target_kl needs target_kl > 0 and init_kl_coef > 0",
            ),
            (self.temperature > 0, "temperature must be > 0"),
            (self.max_grad_norm is None or self.max_grad_norm > 0, "max_grad_norm must be > 0"),
            (self.mini_batch_size >= 1 and self.ppo_epochs >= 1, "need mini_batch_size, "
             "ppo_epochs >= 1"),
            (self.micro_batch_max_tokens >= self.sequence_length >= 1,
             "need micro_batch_max_tokens >= sequence_length >= 1"),
        ]
        for ok, message in checks:
            if not ok:
                raise ValueError(f"LearnerConfig: {message} (got {self})")

    @property
    def uses_reference(self) -> bool:
        """A reference policy is kept iff the KL coefficient can be non-zero."""
        return self.init_kl_coef > 0 or self.target_kl is not None

    def lr_schedule(self, planned_total_updates: int):
        """The progress-driven LR schedule (``algos/schedules.py``) of these settings."""
        return make_progress_lr_schedule(
            self.learning_rate,
            self.lr_scheduler_type,
            self.warmup_steps,
            planned_total_updates,
            self.min_lr_ratio,
        )


@flax.struct.dataclass
class TrainState:
    """Everything the train step reads and writes (a pytree; donated to the step).

    ``step``: updates attempted (one per ``train_step`` call); ``skipped``: of those, how
    many the non-finite guard dropped; ``rng``: advanced every update, so stochastic
    extensions get fresh randomness and a restored run replays it; ``ref_params``: frozen
    reference parameters, or None when no KL is used.
    """

    step: jax.Array
    skipped: jax.Array
    params: Any
    opt_state: Any
    kl: KLControllerState
    rng: jax.Array
    ref_params: Any = None


def _decay_mask(params):
    # Decoupled weight decay on matrices only: decaying norm scales towards 0 and biases
    # has no regularising meaning and hurts (as in GPT-2/Llama recipes).
    return jax.tree.map(lambda p: jnp.ndim(p) >= 2, params)


def make_optimizer(config: LearnerConfig) -> optax.GradientTransformation:
    """``clip_by_global_norm(max_grad_norm) ∘ AdamW`` with an injectable learning rate.

    Reads ``max_grad_norm, learning_rate, adam_b1, adam_b2, adam_eps, weight_decay`` (the
    critic's config has the same fields and shares this optimizer).

    ``inject_hyperparams`` keeps the LR in the optimizer state, so the host sets it per
    update (:func:`set_learning_rate`) without recompiling.
    """
    clip = (
        optax.identity()
        if config.max_grad_norm is None
        else optax.clip_by_global_norm(config.max_grad_norm)
    )
    adamw = optax.inject_hyperparams(optax.adamw, static_args=("mask",))(
        learning_rate=config.learning_rate,
        b1=config.adam_b1,
        b2=config.adam_b2,
        eps=config.adam_eps,
        weight_decay=config.weight_decay,
        mask=_decay_mask,
    )
    return optax.chain(clip, adamw)


def set_learning_rate(opt_state, lr: jax.Array | float):
    """The optimizer state of :func:`make_optimizer` with its LR replaced by ``lr``."""
    clip_state, adamw_state = opt_state
    hyperparams = dict(adamw_state.hyperparams)
    hyperparams["learning_rate"] = jnp.asarray(lr, _F32)
    return clip_state, adamw_state._replace(hyperparams=hyperparams)


def _strong_types(tree):
    # Python-number hyperparameters come out weakly typed; the step returns strong ones. Make
    # them strong up front so the second call hits the first call's compiled program.
    return jax.tree.map(lambda x: jnp.asarray(x, jnp.result_type(x)), tree)


def init_train_state(
    params: Any, config: LearnerConfig, *, ref_params: Any = None
) -> TrainState:
    """Fresh state for ``params`` (an ``nnx.State``). Arrays are copied: the train step
    donates the state, and must not invalidate the caller's arrays.

    ``ref_params`` defaults to a copy of ``params`` when ``config.uses_reference``.
    """
    params = jax.tree.map(jnp.copy, params)
    if config.uses_reference:
        ref_params = jax.tree.map(jnp.copy, params if ref_params is None else ref_params)
    else:
        ref_params = None
    opt_state = set_learning_rate(make_optimizer(config).init(params), config.learning_rate)
    return TrainState(
        step=jnp.zeros((), jnp.int32),
        skipped=jnp.zeros((), jnp.int32),
        params=params,
        opt_state=_strong_types(opt_state),
        kl=init_kl_controller(config.init_kl_coef, config.target_kl, config.kl_horizon),
        rng=jax.random.key(config.seed),
        ref_params=ref_params,
    )


# ----------------------------------------------------------------------------- the math


def _shift_left(x: jax.Array) -> jax.Array:
    """``y[:, i] = x[:, i + 1]``, last column 0: token arrays → prediction index."""
    return jnp.concatenate([x[:, 1:], jnp.zeros_like(x[:, :1])], axis=1)


def _shift_right(x: jax.Array) -> jax.Array:
    """``y[:, t] = x[:, t − 1]``, first column 0: prediction index → token arrays."""
    return jnp.concatenate([jnp.zeros_like(x[:, :1]), x[:, :-1]], axis=1)


def next_token_valid(segment_ids: jax.Array) -> jax.Array:
    """``[B, T]`` bool, prediction index: hidden ``i`` may predict token ``i + 1`` iff both
    lie in the same (non-padding) segment. False on each segment's last token."""
    return (segment_ids > 0) & (segment_ids == _shift_left(segment_ids))


def _hidden_and_head(graphdef, params, micro):
    model = nnx.merge(graphdef, params)
    hidden = model.hidden_states(micro["tokens"], micro["positions"], micro["segment_ids"])
    return hidden, model.lm_head_weight()


def micro_batch_sums(
    graphdef, config: LearnerConfig, params, micro: dict[str, jax.Array], kl_coef
) -> tuple[PolicyLossSums, jax.Array]:
    """``(policy-loss sums, denominator)`` of one group of rows ``[B, T]`` (module doc)."""
    hidden, head = _hidden_and_head(graphdef, params, micro)
    b, t, d = hidden.shape
    segment_ids = micro["segment_ids"]
    mask = _shift_left(micro["loss_mask"]) * next_token_valid(segment_ids)
    # Prediction i sits in token i's segment (= token i+1's wherever mask > 0).
    weights = loss_weights(mask, segment_ids, config.loss_reduction)
    denominator = loss_denominator(mask, segment_ids, config.loss_reduction)
    ref = micro.get("ref_logprobs")
    flat = lambda x: _shift_left(x).reshape(b * t)  # noqa: E731
    sums = policy_loss(
        hidden.reshape(b * t, d),
        head,
        flat(micro["tokens"]),
        flat(micro["old_logprobs"]),
        flat(micro["advantages"]),
        weights.reshape(b * t),
        None if ref is None else flat(ref),
        temperature=config.temperature,
        clip_low=config.pg_clip,
        clip_high=config.pg_clip_high,
        dual_clip=config.dual_clip,
        kl_coef=kl_coef,
        kl_estimator=config.kl_estimator,
        entropy_coef=config.entropy_loss_coef,
        impl=config.kernel_impl,
    )
    return sums, denominator


def _micro_groups(batch: dict[str, jax.Array], group_rows: int) -> dict[str, jax.Array]:
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


def _constrain_rows(micro, mesh):
    if mesh is None:
        return micro
    return lax.with_sharding_constraint(micro, batch_sharding(mesh))


def accumulate_gradients(micro_objective, params, batch, zero_sums, mesh=None):
    """Gradient of ``Σ_micro objective / max(Σ_micro D, 1)`` over a mini-batch, in one scan.

    ``micro_objective(params, micro) -> (objective_sum, (sums, denominator))`` is evaluated
    on groups of ``data · fsdp`` rows; gradient sums, loss sums and denominators accumulate
    in fp32 and the gradient is divided *once* by the global denominator (dividing per
    micro-batch is the bug peers shipped). Returns ``(grads, sums, denominator)``.
    """
    group_rows = 1 if mesh is None else num_batch_shards(mesh)
    grad_fn = jax.grad(micro_objective, has_aux=True)

    def zeros(_):
        return (jax.tree.map(jnp.zeros_like, params),
                (jax.tree.map(jnp.zeros_like, zero_sums), jnp.zeros((), _F32)))

    def body(carry, micro):
        grad_sum, sums_acc, denominator_acc = carry
        micro = _constrain_rows(micro, mesh)
        # A group of padding rows adds exactly nothing: skip its forward and backward.
        grads, (sums, denominator) = lax.cond(
            jnp.any(micro["segment_ids"] > 0), lambda m: grad_fn(params, m), zeros, micro)
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
    (grad_sum, sums, denominator), _ = lax.scan(body, init, _micro_groups(batch, group_rows))
    scale = 1.0 / jnp.maximum(denominator, 1.0)
    return jax.tree.map(lambda g: g * scale, grad_sum), sums, denominator


def apply_if_finite(optimizer, params, opt_state, grads, loss, lr):
    """One optax update with learning rate ``lr``, kept only if ``loss`` and the gradient
    norm are finite. Returns ``(params, opt_state, finite, grad_norm)``."""
    grad_norm = optax.tree.norm(grads)
    finite = jnp.isfinite(loss) & jnp.isfinite(grad_norm)
    updates, new_opt_state = optimizer.update(grads, set_learning_rate(opt_state, lr), params)
    new_params = optax.apply_updates(params, updates)
    return (
        _where_tree(finite, new_params, params),
        _where_tree(finite, new_opt_state, opt_state),
        finite,
        grad_norm,
    )


def make_loss_and_grads(graphdef, config: LearnerConfig, mesh=None):
    """``loss_and_grads(params, batch, kl_coef) -> (grads, sums, denominator)``: gradients of
    the mini-batch loss ``Σ objective / max(D, 1)`` (see :func:`accumulate_gradients`; not
    jitted: the train step and tests jit it)."""
    zero_sums = PolicyLossSums(*(jnp.zeros((), _F32) for _ in PolicyLossSums._fields))

    def loss_and_grads(params, batch, kl_coef):
        def objective(p, micro):
            sums, denominator = micro_batch_sums(graphdef, config, p, micro, kl_coef)
            return sums.objective, (sums, denominator)

        return accumulate_gradients(objective, params, batch, zero_sums, mesh)

    return loss_and_grads


def _where_tree(pred, on_true, on_false):
    return jax.tree.map(lambda a, b: jnp.where(pred, a, b), on_true, on_false)


def make_train_step(graphdef, config: LearnerConfig, mesh, state_shardings):
    """Jitted ``train_step(state, batch, lr) -> (state, metrics)`` (module doc).

    ``batch``: dict of ``[n_micro, row_len]`` arrays (``TRAIN_BATCH_KEYS`` plus
    ``ref_logprobs`` when a reference is used); ``lr``: fp32 scalar for this update.
    ``state_shardings`` (``parallel.train_state_shardings(state, mesh)``) fixes the in/out
    shardings; the state is donated. Metrics are replicated fp32/int32 scalars:
    ``loss, pg_loss, kl, entropy`` (÷ D), ``clipfrac, dual_clipfrac, ratio, approx_kl``
    (÷ tokens), ``grad_norm`` (before clipping), ``lr``, ``kl_coef``, ``tokens``,
    ``denominator``, ``nonfinite``.
    """
    optimizer = make_optimizer(config)
    loss_and_grads = make_loss_and_grads(graphdef, config, mesh)

    def train_step(state: TrainState, batch: dict[str, jax.Array], lr: jax.Array):
        # With the KL folded into the rewards the loss must not penalise it a second time.
        kl_coef = jnp.zeros((), _F32) if config.kl_in_reward else state.kl.coef
        grads, sums, denominator = loss_and_grads(state.params, batch, kl_coef)
        scale = 1.0 / jnp.maximum(denominator, 1.0)
        loss = sums.objective * scale
        params, opt_state, finite, grad_norm = apply_if_finite(
            optimizer, state.params, state.opt_state, grads, loss, lr
        )
        rng, _ = jax.random.split(state.rng)
        new_state = state.replace(
            step=state.step + 1,
            skipped=state.skipped + (~finite).astype(jnp.int32),
            params=params,
            opt_state=opt_state,
            rng=rng,
        )
        per_token = 1.0 / jnp.maximum(sums.num_tokens, 1.0)
        metrics = {
            "loss": loss,
            "pg_loss": sums.pg * scale,
            "kl": sums.kl * scale,
            "entropy": sums.entropy * scale,
            "clipfrac": sums.clipped * per_token,
            "dual_clipfrac": sums.dual_clipped * per_token,
            "ratio": sums.ratio * per_token,
            "approx_kl": sums.approx_kl_old * per_token,
            "grad_norm": grad_norm,
            "lr": jnp.asarray(lr, _F32),
            "kl_coef": kl_coef,
            "tokens": sums.num_tokens,
            "denominator": denominator,
            "nonfinite": (~finite).astype(jnp.int32),
        }
        return new_state, metrics

    repl = replicated(mesh)
    return jax.jit(
        train_step,
        in_shardings=(state_shardings, batch_sharding(mesh), repl),
        out_shardings=(state_shardings, repl),
        donate_argnums=0,
    )


def make_compute_logprobs(graphdef, config: LearnerConfig, mesh, param_shardings):
    """Jitted ``compute_logprobs(params, batch) -> [n_micro, row_len]`` fp32 token logprobs.

    Entry ``t`` is ``log π(token_t | tokens < t of its segment)`` at ``config.temperature``;
    0 on padding and on each segment's first token (nothing to condition on). Used for the
    reference logprobs (with ``ref_params``) and for recomputed old logprobs. ``batch`` needs
    ``LOGPROB_BATCH_KEYS``; rows are scanned in groups of ``data · fsdp`` like the train step.
    """
    group_rows = num_batch_shards(mesh)

    def compute_logprobs(params, batch):
        def rows_logprobs(micro):
            hidden, head = _hidden_and_head(graphdef, params, micro)
            b, t, d = hidden.shape
            logprobs = token_logprobs(
                hidden.reshape(b * t, d),
                head,
                _shift_left(micro["tokens"]).reshape(b * t),
                config.temperature,
                impl=config.kernel_impl,
            ).reshape(b, t)
            valid = next_token_valid(micro["segment_ids"])
            return _shift_right(jnp.where(valid, logprobs, 0.0))

        def body(_, micro):
            micro = _constrain_rows(micro, mesh)
            return None, lax.cond(jnp.any(micro["segment_ids"] > 0), rows_logprobs,
                                  lambda m: jnp.zeros(m["tokens"].shape, _F32), micro)

        batch = {k: batch[k] for k in LOGPROB_BATCH_KEYS}
        _, out = lax.scan(body, None, _micro_groups(batch, group_rows))
        # Undo _micro_groups: [groups, group_rows, T] → [n_micro, T].
        return jnp.swapaxes(out, 0, 1).reshape(-1, out.shape[-1])

    return jax.jit(
        compute_logprobs,
        in_shardings=(param_shardings, batch_sharding(mesh)),
        out_shardings=batch_sharding(mesh),
    )


# ----------------------------------------------------------------------------- host side


def _aggregate(per_update: list[dict[str, np.ndarray]]) -> dict[str, float]:
    """Means over the updates that were applied (a skipped update's loss is NaN/inf)."""
    applied = [m for m in per_update if int(m["nonfinite"]) == 0]
    names = {
        "loss": "loss/total",
        "pg_loss": "loss/pg",
        "kl": "loss/kl",
        "entropy": "loss/entropy",
        "clipfrac": "policy/clipfrac",
        "dual_clipfrac": "policy/dual_clipfrac",
        "ratio": "policy/ratio",
        "approx_kl": "policy/approx_kl",
        "grad_norm": "optim/grad_norm",
    }
    out = {}
    for key, name in names.items():
        values = [float(m[key]) for m in applied]
        out[name] = float(np.mean(values)) if values else float("nan")
    return out


def computed_slots(batch: PackedBatch, mesh) -> int:
    """Token slots the train step really computes: the scan skips groups of rows (one per
    batch shard, rows ``j, j + groups, …``) that hold only padding."""
    shards = num_batch_shards(mesh)
    groups = batch.num_micro_batches // shards
    busy = (batch.segment_ids > 0).any(axis=1).reshape(shards, groups).any(axis=0)
    return int(busy.sum()) * shards * batch.row_len


def pad_to_shards(batch: PackedBatch, mesh, pad_token_id: int) -> PackedBatch:
    """``batch`` with empty rows appended so its row count divides the batch shards."""
    shards = num_batch_shards(mesh)
    rows = round_up_to_bucket(batch.num_micro_batches, shards)
    if rows == batch.num_micro_batches:
        return batch
    return pad_rows(batch, rows, pad_token_id=pad_token_id)


def put_batch(batch: PackedBatch, keys: Sequence[str], mesh) -> dict[str, jax.Array]:
    """The named token arrays of ``batch``, placed with the mesh's batch sharding."""
    arrays = batch.token_arrays()
    return put_rows({k: arrays[k] for k in keys}, mesh)


def per_sample_outputs(samples: Sequence[Sample], config, mesh, compute, params,
                       keys: Sequence[str]) -> list[np.ndarray]:
    """Per-sample ``[len(sample)]`` fp32 results of a jitted per-token ``compute(params,
    batch) -> [n_micro, row_len]`` run on ``samples`` packed for ``mesh``; 0 beyond
    ``sequence_length``. ``config`` supplies the packing fields (learner's or critic's)."""
    num_rows = None
    if getattr(config, "fixed_rows", False):  # one sample per row at most: a stable shape
        shards = num_batch_shards(mesh)
        num_rows = round_up_to_bucket(bucket_rows(len(samples), 0), shards)
    batch = pad_to_shards(
        pack_samples(
            samples,
            micro_batch_max_tokens=config.micro_batch_max_tokens,
            sequence_length=config.sequence_length,
            rows_bucket=config.rows_bucket,
            num_rows=num_rows,
            pad_token_id=config.pad_token_id,
        ),
        mesh,
        config.pad_token_id,
    )
    per_token = to_host(compute(params, put_batch(batch, keys, mesh)))
    out = [np.zeros(len(s), np.float32) for s in samples]
    for row, column in zip(*np.nonzero(batch.sample_index >= 0), strict=True):
        values = per_token[row][batch.segment_ids[row] == column + 1]
        out[batch.sample_index[row, column]][: len(values)] = values
    return out


def truncated_importance_weights(samples: Sequence[Sample], old_logprobs: Sequence[np.ndarray],
                                 cap: float) -> tuple[list[Sample], dict[str, float]]:
    """Samples whose advantages carry w_t = min(exp(log π_old − log μ), cap) on loss tokens
    (μ = the sampler's behaviour logprobs in ``sample.old_logprobs``), and the metrics
    ``off_policy/tis_weight_mean`` and ``off_policy/tis_capped_frac`` over loss tokens."""
    out, weights = [], []
    for s, old in zip(samples, old_logprobs, strict=True):
        mask = s.loss_mask > 0
        w = np.where(mask, np.minimum(np.exp(old - s.old_logprobs), cap), 1.0).astype(np.float32)
        weights.append(w[mask])
        out.append(dataclasses.replace(s, advantages=(s.advantages * w).astype(np.float32)))
    w = np.concatenate(weights) if weights else np.zeros(0, np.float32)
    return out, {"off_policy/tis_weight_mean": float(w.mean()) if w.size else 1.0,
                 "off_policy/tis_capped_frac": float((w >= cap).mean()) if w.size else 0.0}


class Learner:
    """Host driver of one pipeline step: samples in, ``ppo_epochs · ceil(n / mini_batch)``
    optimizer updates, metrics out.

    ``step(samples, learning_rates)``: (optionally) recompute old logprobs and fill reference
    logprobs with the frozen reference, split into mini-batches (reshuffled per epoch), pack
    each to one common bucketed ``[n_micro, micro_batch_max_tokens]`` shape (``n_micro`` a
    multiple of the mesh's batch shards), run one ``train_step`` per mini-batch with its LR,
    then advance the KL controller. The current parameters are ``learner.params``.
    """

    def __init__(
        self,
        graphdef,
        params,
        config: LearnerConfig,
        mesh=None,
        *,
        ref_params: Any = None,
    ):
        self.config = config
        self.graphdef = graphdef
        self.mesh = make_mesh() if mesh is None else mesh
        state = init_train_state(params, config, ref_params=ref_params)
        self.state_shardings = train_state_shardings(state, self.mesh)
        self.state = place(state, self.state_shardings)
        self.train_step = make_train_step(graphdef, config, self.mesh, self.state_shardings)
        self.compute_logprobs = make_compute_logprobs(
            graphdef, config, self.mesh, self.state_shardings.params
        )
        self.np_rng = np.random.default_rng(config.seed)
        self._batch_keys = TRAIN_BATCH_KEYS + (
            ("ref_logprobs",) if config.uses_reference else ()
        )

    @property
    def params(self):
        return self.state.params

    # ---- logprobs -------------------------------------------------------------------------
    def sample_logprobs(self, samples: Sequence[Sample], *, reference: bool = False):
        """Per-sample ``[len(sample)]`` logprobs under the current (or reference) params;
        0 on each sample's first token and beyond ``sequence_length`` (truncated)."""
        params = self.state.ref_params if reference else self.state.params
        if params is None:
            raise ValueError("no reference parameters: the config uses no KL")
        return per_sample_outputs(samples, self.config, self.mesh, self.compute_logprobs,
                                  params, LOGPROB_BATCH_KEYS)

    def fill_ref_logprobs(self, samples: Sequence[Sample]) -> list[Sample]:
        """Samples with ``ref_logprobs`` from the frozen reference (on generated tokens)."""
        ref = self.sample_logprobs(samples, reference=True)
        return [
            dataclasses.replace(s, ref_logprobs=np.where(s.loss_mask > 0, r, 0.0))
            for s, r in zip(samples, ref, strict=True)
        ]

    # ---- one pipeline step ----------------------------------------------------------------
    def step(self, samples: Sequence[Sample], learning_rates: Sequence[float]) -> dict:
        """Runs the updates of one pipeline step; returns host-side float metrics."""
        cfg = self.config
        if not samples:
            raise ValueError("Learner.step got no samples")
        num_updates = updates_per_step(len(samples), cfg.mini_batch_size, cfg.ppo_epochs)
        lrs = np.asarray(learning_rates, np.float32).reshape(-1)
        if lrs.shape != (num_updates,):
            raise ValueError(
                f"{len(samples)} samples make {num_updates} updates "
                f"(mini_batch_size={cfg.mini_batch_size}, ppo_epochs={cfg.ppo_epochs}) but "
                f"{lrs.size} learning rates were given"
            )
        extra: dict[str, float] = {}
        samples = list(samples)
        if cfg.recompute_old_logprobs:
            recomputed = self.sample_logprobs(samples)
            loss_tokens = sum(s.num_loss_tokens for s in samples)
            gap = sum(
                float(np.abs(s.old_logprobs - r)[s.loss_mask > 0].sum())
                for s, r in zip(samples, recomputed, strict=True)
            )
            extra["rollout/logprob_mismatch"] = gap / max(loss_tokens, 1)
            if cfg.tis_imp_ratio_cap > 0:
                samples, tis_metrics = truncated_importance_weights(
                    samples, recomputed, cfg.tis_imp_ratio_cap)
                extra.update(tis_metrics)
            samples = [
                dataclasses.replace(s, old_logprobs=np.where(s.loss_mask > 0, r, 0.0))
                for s, r in zip(samples, recomputed, strict=True)
            ]
        if cfg.uses_reference:
            if any(s.ref_logprobs is None for s in samples):
                samples = self.fill_ref_logprobs(samples)
        else:
            samples = [dataclasses.replace(s, ref_logprobs=None) for s in samples]

        minibatches = split_minibatches(samples, cfg.mini_batch_size, cfg.ppo_epochs, self.np_rng)
        shards = num_batch_shards(self.mesh)
        packed = pack_minibatches(
            minibatches,
            micro_batch_max_tokens=cfg.micro_batch_max_tokens,
            sequence_length=cfg.sequence_length,
            rows_bucket=cfg.rows_bucket,
            # A mini-batch never needs more rows than samples (each fits one row).
            num_micro_batches=round_up_to_bucket(cfg.mini_batch_size, shards) if cfg.fixed_rows
            else None,
            pad_token_id=cfg.pad_token_id,
        )
        packed = [pad_to_shards(b, self.mesh, cfg.pad_token_id) for b in packed]
        per_update = []
        for batch, lr in zip(packed, lrs, strict=True):
            arrays = put_batch(batch, self._batch_keys, self.mesh)
            self.state, metrics = self.train_step(self.state, arrays, lr)
            per_update.append(metrics)
        per_update = jax.device_get(per_update)  # one host sync for the whole step

        out = _aggregate(per_update)
        applied_kl = [float(m["kl"]) for m in per_update if int(m["nonfinite"]) == 0]
        if self.state.kl.adaptive and applied_kl:
            # Sequence-level KL for seq_mean_token_sum, per-token otherwise (the reduction's).
            kl_state = update_kl_controller(self.state.kl, np.mean(applied_kl), len(samples))
            kl_state = place(kl_state, self.state_shardings.kl)
            self.state = self.state.replace(kl=kl_state)

        stats = [token_stats(b) for b in packed]
        out.update(
            {
                "kl/coef": float(self.state.kl.coef),
                "optim/lr": float(np.mean(lrs)),
                "optim/num_updates": float(self.state.step),
                "optim/updates_this_step": float(num_updates),
                "optim/nonfinite_updates": float(sum(int(m["nonfinite"]) for m in per_update)),
                "tokens/real": sum(s["real_tokens"] for s in stats),
                "tokens/loss": float(sum(float(m["tokens"]) for m in per_update)),
                "tokens/computed": float(sum(computed_slots(b, self.mesh) for b in packed)),
                "batch/num_samples": float(len(samples)),
                "batch/num_micro_batches": float(packed[0].num_micro_batches),
                "batch/max_micro_batch_tokens": max(
                    s["max_micro_batch_real_tokens"] for s in stats
                ),
                "batch/padded_seq_len": float(packed[0].row_len),
                "batch/num_truncated": float(
                    sum(len(s) > cfg.sequence_length for s in samples)
                ),
                **extra,
            }
        )
        out["tokens/efficiency"] = out["tokens/real"] / max(out["tokens/computed"], 1.0)
        return out
