"""One optimizer update over a packed mini-batch, and the host loop that feeds it.

The policy learner (``learner.py``) and the GAE critic (``critic.py``) train the same way
and differ only in their loss, their batch keys and their metrics (as Tunix's one trainer
takes a loss function). This module is that shared way:

    for each group of micro-batch rows (lax.scan):              # fp32 accumulators
        objective_m, (sums_m, D_m) = micro_objective(θ, rows)   # weighted sums (Tunix)
        G += ∇_θ objective_m;   O += objective_m;   S += sums_m;   D += D_m
    g = G / max(D, 1);   loss = O / max(D, 1)                   # the one division
    if loss and |g| are finite:  g = clip(g);  θ ← AdamW(θ, g, lr)

so the update equals the one computed on the whole mini-batch at once, however the packer
split it into micro-batches (dividing per micro-batch is the bug peers shipped). A scan step
takes ``data · fsdp`` rows at once (one per batch shard of the mesh). A group of rows that
holds only padding is skipped: it would add exactly nothing; one whose real tokens end
early runs on a shorter prefix of its rows (``on_shortest_prefix``, ``row_prefixes``).

**Non-finite guard.** If the loss or the gradient norm is NaN/inf the update is skipped:
parameters and optimizer state are returned unchanged and ``metrics["nonfinite"] = 1``.

Host side, one pipeline step (:class:`UpdateEngine`): split the samples into mini-batches
(reshuffled per epoch) → pack each to one common ``[n_micro, micro_batch_max_tokens]`` shape
(``data/minibatch.pack_minibatches``) → put on the mesh → one jitted update per mini-batch
with its learning rate → one host fetch of all metrics.

The scan over groups of rows is ``accumulation.py``'s; the per-token passes without a
gradient (logprobs, values) are ``per_token.py``'s.
"""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Callable, Sequence
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
import optax
from jax import lax

from jaxrl_agentic.data import (
    PackedBatch,
    PackingConfig,
    Sample,
    pack_minibatches,
    pad_rows,
    round_up_to_bucket,
    split_minibatches,
    spread_rows,
    updates_per_step,
)
from jaxrl_agentic.models import lora
from jaxrl_agentic.runtime.parallel import (
    batch_sharding,
    num_batch_shards,
    place,
    put_rows,
    replicated,
    stacked_layer_dims,
)
from jaxrl_agentic.training.accumulation import accumulate_gradient_sums, scale_gradients
from pallas_kernels import use_mesh_for_kernels

_F32 = jnp.float32


@dataclasses.dataclass(frozen=True)
class UpdateConfig:
    """Settings every trained model shares: optimizer, mini-batching and packing.

    ``learning_rate`` is the peak LR (the host passes each update's LR; see
    ``algos/schedules.py``); ``max_grad_norm`` None = no clipping;
    ``relative_grad_clip`` (None = off) also clips to that multiple of the typical recent
    gradient norm (:func:`clip_by_relative_global_norm`); AdamW's decoupled
    ``weight_decay`` applies to matrices only. ``head_learning_rate`` (None = the same): the
    output head's peak LR, following the same schedule (:func:`scale_head_updates`);
    ``loraplus_lr_ratio`` (1 = off): LoRA+'s η_B / η_A, the B adapters' LR as a multiple of
    ``learning_rate`` (:func:`scale_lora_b_updates`). Each pipeline step makes
    ``ppo_epochs · ceil(n / mini_batch_size)`` updates. ``seed`` seeds the mini-batch
    shuffle. Defaults equal the run defaults (``config.default_config``).

    A rule that fails raises ``ValueError("<field>: <why>")``; ``config.validate`` reports it
    as ``config.<field>: <why>``.
    """

    learning_rate: float = 1e-5
    max_grad_norm: float | None = 1.0
    relative_grad_clip: float | None = None
    weight_decay: float = 0.0
    adam_b1: float = 0.9
    adam_b2: float = 0.999
    adam_eps: float = 1e-8
    mini_batch_size: int = 32
    ppo_epochs: int = 1
    seed: int = 0
    packing: PackingConfig = PackingConfig()
    head_learning_rate: float | None = None
    loraplus_lr_ratio: float = 1.0

    def __post_init__(self):
        checks = [
            (self.learning_rate >= 0, "learning_rate", "must be >= 0"),
            (self.max_grad_norm is None or self.max_grad_norm > 0, "max_grad_norm",
             "must be > 0"),
            (self.relative_grad_clip is None or self.relative_grad_clip > 0,
             "relative_grad_clip", "must be > 0 (0 or None: off)"),
            (self.weight_decay >= 0, "weight_decay", "must be >= 0"),
            (self.head_learning_rate is None or self.head_learning_rate >= 0,
             "head_learning_rate", "must be >= 0 (0 or None: learning_rate)"),
            (self.loraplus_lr_ratio > 0, "loraplus_lr_ratio", "must be > 0 (1: off)"),
            (self.mini_batch_size >= 1, "mini_batch_size", "must be >= 1"),
            (self.ppo_epochs >= 1, "ppo_epochs", "must be >= 1"),
        ]
        fail_first(checks, self)


def fail_first(checks, config) -> None:
    """Raises ``ValueError("<field>: <why> (got <value>)")`` for the first failed check
    ``(ok, field, why)``: the one format typed configs use for ``config.validate``."""
    for ok, field, why in checks:
        if not ok:
            raise ValueError(f"{field}: {why} (got {getattr(config, field)!r})")


# ----------------------------------------------------------------------------- optimizer


def _decay_mask(params):
    # Decoupled weight decay on matrices only: decaying norm scales towards 0 and biases
    # has no regularising meaning and hurts (as in GPT-2/Llama recipes). A decoder block's
    # weights carry a leading layer axis, which does not make a vector a matrix.
    return jax.tree_util.tree_map_with_path(
        lambda path, p: jnp.ndim(p) - stacked_layer_dims(path) >= 2, params)


class RelativeClipState(NamedTuple):
    log_norm_ema: jax.Array  # fp32: EMA of log |g| over the updates so far
    count: jax.Array  # int32: updates so far


def clip_gradients(max_norm: float | None = None, relative: float | None = None,
                   decay: float = 0.95) -> optax.GradientTransformationExtraArgs:
    """The gradient clips, each off when None, as one multiply of the gradient by a scalar:

        g ← g · s_rel · s_fix,    s_fix = min(1, max_norm / (s_rel · |g|))

    **Fixed** (``max_norm``): optax's ``clip_by_global_norm``.
    **Relative** (``relative`` = F): clip to F times the typical norm of the gradients
    before it,

        ḡ_t = exp(m_{t-1} / (1 − decay^{t-1}))        (bias-corrected geometric mean)
        s_rel = min(1, F · ḡ_t / |g_t|);   m_t = decay · m_{t-1} + (1 − decay) · log|g_t|

    The first gradient passes unclipped. The threshold follows the gradient's own scale, so
    it means the same thing whatever sets that scale: the loss reduction and the number of
    loss tokens per reply (a token mean over a four-token reply is a quarter of the
    one-token reply's), the reward scale, the model. A fixed ``max_grad_norm`` does not:
    the same setting can clip every update of one recipe and none of another's, whose rare
    spikes (from broken replies) then pass into Adam's moments at full size
    (docs/algorithms.md, "Generated format tokens and the gradient clip"). The EMA is of log
    norms, so one spike moves the threshold by a factor, not by its size.

    ``update(grads, state, params, global_norm=|g|)`` takes the norm the caller already has
    (the train step's non-finite guard), so the gradient is not read again for it. And the
    clip is a multiply by one scalar, which XLA fuses into Adam's moments: optax's clip
    divides every element by |g|, and XLA:CPU kept that clipped copy of the whole gradient
    as a buffer (``tests/training/test_update_memory.py``).
    """

    def init(params):
        del params
        if relative is None:
            return optax.EmptyState()
        return RelativeClipState(jnp.zeros((), _F32), jnp.zeros((), jnp.int32))

    def update(grads, state, params=None, *, global_norm=None, **extra_args):
        del params, extra_args
        norm = optax.tree.norm(grads) if global_norm is None else global_norm
        norm = jnp.asarray(norm, _F32)
        factor = jnp.ones((), _F32)
        if relative is not None:
            seen = state.count.astype(_F32)
            typical = jnp.exp(state.log_norm_ema / jnp.maximum(1.0 - decay ** seen, 1e-12))
            threshold = jnp.where(state.count > 0, relative * typical, jnp.inf)
            factor = jnp.where(norm > threshold, threshold / norm, 1.0)
            log_norm = jnp.log(jnp.maximum(norm, jnp.finfo(_F32).tiny))
            ema = decay * state.log_norm_ema + (1.0 - decay) * log_norm
            state = RelativeClipState(ema, state.count + 1)
        if max_norm is not None:
            clipped = norm * factor
            factor = factor * jnp.where(clipped < max_norm, 1.0, max_norm / clipped)
        return jax.tree.map(lambda g: (g * factor).astype(g.dtype), grads), state

    return optax.GradientTransformationExtraArgs(init, update)


def clip_by_relative_global_norm(factor: float, decay: float = 0.95
                                 ) -> optax.GradientTransformationExtraArgs:
    """The relative clip alone (:func:`clip_gradients`)."""
    return clip_gradients(relative=factor, decay=decay)


def is_head(path) -> bool:
    """Whether a parameter path is the output head's (``lm_head``; a tied head is the
    embedding and has no path of its own)."""
    return _names(path, "lm_head")


def _names(path, name: str) -> bool:
    """Whether a parameter path has a key or attribute called ``name``."""
    return any(getattr(key, "key", getattr(key, "name", None)) == name for key in path)


def scale_updates(ratio: float, where) -> optax.GradientTransformation:
    """Multiplies the updates of the leaves whose path satisfies ``where(path)`` by
    ``ratio``.

    After AdamW the update of a leaf is −η·(m̂/(√v̂ + ε) + λ·w), linear in η, so scaling it is
    training that leaf at η·ratio on the same schedule.
    """
    return optax.masked(optax.scale(ratio), lambda params: jax.tree_util.tree_map_with_path(
        lambda path, _: where(path), params))


def scale_head_updates(ratio: float) -> optax.GradientTransformation:
    """The output head trained at ``ratio`` × the LR (:func:`scale_updates`). LoRA with a
    trained head (``models/lora.py``) is the case: the adapters need a larger LR than full
    training's, the head, trained in full, does not (docs/benchmarks.md, "LoRA rank 16")."""
    return scale_updates(ratio, is_head)


def is_lora_b(path) -> bool:
    """Whether a parameter path is a LoRA B adapter (``…/lora_b``)."""
    return _names(path, "lora_b")


def scale_lora_b_updates(ratio: float) -> optax.GradientTransformation:
    """LoRA+ (Hayou, Ghosh & Yu, 2024): the B adapters trained at η_B = ``ratio`` · η, the A
    adapters at η. With B = 0 at the start, s·A·B moves through B first; for features to
    move at the rate full training moves them at large width, η_B must be much larger than
    η_A, which one shared LR cannot give (:func:`scale_updates`)."""
    return scale_updates(ratio, is_lora_b)


def make_optimizer(config: UpdateConfig) -> optax.GradientTransformationExtraArgs:
    """``clip ∘ AdamW`` with an injectable learning rate; ``clip`` is
    :func:`clip_gradients` (``max_grad_norm``, ``relative_grad_clip``; either may be off),
    whose ``update`` takes ``global_norm=`` (the norm of the gradient it is given); with a
    ``head_learning_rate`` of its own, the head's updates are then rescaled
    (:func:`scale_head_updates`), and with a ``loraplus_lr_ratio`` the B adapters'
    (:func:`scale_lora_b_updates`).

    ``inject_hyperparams`` keeps the LR in the optimizer state, so the host sets it per
    update (:func:`set_learning_rate`) without recompiling.
    """
    clip = clip_gradients(config.max_grad_norm, config.relative_grad_clip)
    adamw = optax.inject_hyperparams(optax.adamw, static_args=("mask",))(
        learning_rate=config.learning_rate,
        b1=config.adam_b1,
        b2=config.adam_b2,
        eps=config.adam_eps,
        weight_decay=config.weight_decay,
        mask=_decay_mask,
    )
    rescale = [rate.scale(rate.ratio) for rate in _leaf_rates(config) if rate.ratio != 1.0]
    return optax.chain(clip, adamw, *rescale)


class _LeafRate(NamedTuple):
    field: str
    scale: Any  # ratio -> the rescaling transformation
    ratio: float  # to the LR
    needs: Any  # path -> whether the leaf is one it rescales
    missing: str  # the error when the model has none of them


def _leaf_rates(config: UpdateConfig) -> list[_LeafRate]:
    """The per-leaf rates the config sets: ``head_learning_rate`` (set even when equal to the
    LR: it still needs a trained head) and ``loraplus_lr_ratio`` (≠ 1)."""
    rates = []
    if config.head_learning_rate is not None:
        ratio = (config.head_learning_rate / config.learning_rate
                 if config.learning_rate != 0 else 1.0)
        rates.append(_LeafRate("head_learning_rate", scale_head_updates, ratio, is_head,
                               "the model has no output head that trains (tied to the "
                               "embedding, or frozen beside LoRA adapters)"))
    if config.loraplus_lr_ratio != 1.0:
        rates.append(_LeafRate("loraplus_lr_ratio", scale_lora_b_updates,
                               config.loraplus_lr_ratio, is_lora_b,
                               "the model has no LoRA adapters (set lora_rank)"))
    return rates


def set_learning_rate(opt_state, lr: jax.Array | float):
    """The optimizer state of :func:`make_optimizer` with its LR replaced by ``lr``."""
    clip_state, adamw_state, *rest = opt_state
    hyperparams = dict(adamw_state.hyperparams)
    hyperparams["learning_rate"] = jnp.asarray(lr, _F32)
    return (clip_state, adamw_state._replace(hyperparams=hyperparams), *rest)


def init_optimizer_state(params: Any, config: UpdateConfig):
    """The optimizer state for ``params``, its LR set to ``config.learning_rate``, all leaves
    strongly typed: Python-number hyperparameters come out weakly typed and the step returns
    strong ones, so the second call would otherwise miss the first call's compiled program."""
    paths = [path for path, _ in jax.tree_util.tree_leaves_with_path(params)]
    for rate in _leaf_rates(config):
        if not any(rate.needs(path) for path in paths):
            raise ValueError(f"{rate.field}: {rate.missing}")
    opt_state = set_learning_rate(make_optimizer(config).init(params), config.learning_rate)
    return jax.tree.map(lambda x: jnp.asarray(x, jnp.result_type(x)), opt_state)


# ----------------------------------------------------------------------------- the step


def apply_if_finite(optimizer, params, opt_state, grads, loss, lr, grad_scale=1.0):
    """One optax update with learning rate ``lr`` and gradient ``grads · grad_scale``, kept
    only if ``loss`` and the gradient norm are finite. Returns ``(params, opt_state,
    finite, grad_norm)``.

    The scale is applied inside the update, where XLA fuses it into each use: a scaled
    copy passed into the ``lax.cond`` was one more buffer the size of the gradient.

    The update runs inside a ``lax.cond``: its false branch returns the state untouched, so
    the new parameters and moments are written over the donated ones leaf by leaf. Choosing
    between a computed new state and the old one with ``jnp.where`` kept both alive in the
    update step's temporaries (``tests/training/test_update_memory.py``).
    """
    # |g · s| = |g| · s, read from the gradient as it came out of the backward: a norm is a
    # reduction XLA:CPU runs as a library call, which takes its input from a buffer, so the
    # norm of a scaled gradient made XLA keep the scaled copy.
    grad_norm = optax.tree.norm(jax.tree.map(lambda g: g.astype(_F32), grads)) * grad_scale
    finite = jnp.isfinite(loss) & jnp.isfinite(grad_norm)

    def apply(params, opt_state, grads):
        updates, new_opt_state = optimizer.update(scale_gradients(grads, grad_scale),
                                                  set_learning_rate(opt_state, lr), params,
                                                  global_norm=grad_norm)
        return optax.apply_updates(params, updates), new_opt_state

    params, opt_state = lax.cond(finite, apply, lambda p, s, g: (p, s), params, opt_state,
                                 grads)
    return params, opt_state, finite, grad_norm


@dataclasses.dataclass(frozen=True)
class UpdateLoss:
    """What makes one trained model different from another (Tunix passes a loss function).

    ``micro_sums(params, micro, state[, teacher]) -> (sums, denominator)``: weighted sums of
    one group of rows (a NamedTuple of fp32 scalars) and its reduction denominator
    (``teacher``: a frozen model's params the update step was given, when it was);
    ``objective(sums)``: the sum that carries the gradient; ``zero_sums``: the sums'
    zeros; ``metrics(state, sums, scale)``: the model's own step metrics (replicated
    scalars; ``scale = 1 / max(D, 1)``); ``advance(state)``: fields of the new state besides
    the update (e.g. a fresh rng), as a dict.
    """

    micro_sums: Callable
    objective: Callable
    zero_sums: Any
    metrics: Callable
    advance: Callable = lambda state: {}


def kernels_see_mesh(mesh):
    """Decorator: ``fn`` is traced with ``mesh`` as JAX's abstract mesh, so the accelerator
    kernels inside it run once per device on that device's rows
    (``pallas_kernels._per_shard``: XLA cannot partition a Pallas kernel, and refuses a
    Mosaic one outright). On CPU the kernels are plain JAX and do not look at it."""
    def wrap(fn):
        if mesh is None:
            return fn

        @functools.wraps(fn)
        def traced(*args):
            with use_mesh_for_kernels(mesh):
                return fn(*args)
        return traced
    return wrap


def make_update_step(loss: UpdateLoss, config: UpdateConfig, mesh, state_shardings,
                     compiler_options: dict | None = None, frozen_shardings=None,
                     teacher_shardings=None):
    """Jitted ``update_step(state, batch, lr[, frozen][, teacher]) -> (state, metrics)``: one
    update (module doc). ``compiler_options``: XLA's, for the program
    (``pallas_kernels._same_bits``). ``frozen`` (an argument when ``frozen_shardings`` are
    given): under LoRA the base weights (``models/lora.py``), which the loss reads with
    ``state.params`` (the adapters) and which are neither differentiated nor donated, so the
    sampler may go on reading them. ``teacher`` (an argument when ``teacher_shardings`` are
    given): a distillation teacher's params, passed to ``loss.micro_sums``, neither
    differentiated nor donated either.

    ``state`` has ``step``, ``skipped``, ``params`` and ``opt_state`` (and whatever the loss
    reads); it is donated. ``batch``: dict of ``[n_micro, row_len]`` arrays. Metrics:
    ``loss`` (÷ D), ``grad_norm`` (before clipping), ``lr``, ``nonfinite``, ``denominator``
    and the loss's own.
    """
    optimizer = make_optimizer(config)

    @kernels_see_mesh(mesh)
    def update_step(state, batch: dict[str, jax.Array], lr: jax.Array, frozen=None,
                    teacher=None):
        def micro_objective(params, micro):
            model = params if frozen is None else lora.combine(params, frozen)
            with_teacher = () if teacher is None else (teacher,)
            sums, denominator = loss.micro_sums(model, micro, state, *with_teacher)
            return loss.objective(sums), (sums, denominator)

        grad_sum, sums, denominator = accumulate_gradient_sums(
            micro_objective, state.params, batch, loss.zero_sums, mesh,
            config.packing.row_prefixes)
        scale = 1.0 / jnp.maximum(denominator, 1.0)
        value = loss.objective(sums) * scale
        params, opt_state, finite, grad_norm = apply_if_finite(
            optimizer, state.params, state.opt_state, grad_sum, value, lr, scale)
        new_state = state.replace(
            step=state.step + 1,
            skipped=state.skipped + (~finite).astype(jnp.int32),
            params=params,
            opt_state=opt_state,
            **loss.advance(state),
        )
        metrics = {
            "loss": value,
            "grad_norm": grad_norm,
            "lr": jnp.asarray(lr, _F32),
            "nonfinite": (~finite).astype(jnp.int32),
            "denominator": denominator,
            **loss.metrics(state, sums, scale),
        }
        return new_state, metrics

    repl = replicated(mesh)
    jit = functools.partial(jax.jit, out_shardings=(state_shardings, repl), donate_argnums=0,
                            compiler_options=compiler_options)
    if frozen_shardings is None and teacher_shardings is None:  # (state, batch, lr)
        def without_extras(state, batch, lr):
            return update_step(state, batch, lr)

        without_extras.__name__ = without_extras.__qualname__ = "update_step"  # program name
        return jit(without_extras, in_shardings=(state_shardings, batch_sharding(mesh), repl))
    extras = tuple(s for s in (frozen_shardings, teacher_shardings) if s is not None)

    def with_extras(state, batch, lr, *args):  # (state, batch, lr[, frozen][, teacher])
        rest = iter(args)
        frozen = next(rest) if frozen_shardings is not None else None
        return update_step(state, batch, lr, frozen, next(rest, None))

    with_extras.__name__ = with_extras.__qualname__ = "update_step"  # the program's name
    return jit(with_extras, in_shardings=(state_shardings, batch_sharding(mesh), repl,
                                          *extras))


# ----------------------------------------------------------------------------- host side


def pad_to_shards(batch: PackedBatch, mesh, pad_token_id: int) -> PackedBatch:
    """``batch`` with empty rows appended so its row count divides the batch shards, and
    its rows spread over them (``spread_rows``: each device gets its share of real rows)."""
    shards = num_batch_shards(mesh)
    rows = round_up_to_bucket(batch.num_micro_batches, shards)
    if rows != batch.num_micro_batches:
        batch = pad_rows(batch, rows, pad_token_id=pad_token_id)
    return spread_rows(batch, shards)


def put_batch(batch: PackedBatch, keys: Sequence[str], mesh) -> dict[str, jax.Array]:
    """The named token arrays of ``batch``, placed with the mesh's batch sharding."""
    arrays = batch.device_arrays()
    return put_rows({k: arrays[k] for k in keys}, mesh)


def check_learning_rates(learning_rates, num_samples: int, config: UpdateConfig,
                         what: str) -> np.ndarray:
    """One fp32 LR per update of a step of ``num_samples`` samples, or a one-line error."""
    num_updates = updates_per_step(num_samples, config.mini_batch_size, config.ppo_epochs)
    lrs = np.asarray(learning_rates, np.float32).reshape(-1)
    if lrs.shape != (num_updates,):
        raise ValueError(
            f"{num_samples} samples make {num_updates} {what} updates "
            f"(mini_batch_size={config.mini_batch_size}, ppo_epochs={config.ppo_epochs}) but "
            f"{lrs.size} learning rates were given"
        )
    return lrs


class UpdateEngine:
    """The host loop of one pipeline step for one trained model (module doc).

    Holds the train state (placed on ``mesh`` with ``state_shardings``), the jitted update
    step and the mini-batch shuffle. ``run(samples, lrs)`` makes the step's updates and
    returns the fetched per-update metrics and the packed batches they ran on.
    """

    def __init__(self, state, loss: UpdateLoss, config: UpdateConfig, mesh, state_shardings,
                 batch_keys: Sequence[str], compiler_options: dict | None = None,
                 frozen=None, frozen_shardings=None, teacher=None, teacher_shardings=None):
        """``frozen``: LoRA's base weights, read by every update, never changed;
        ``teacher``: a distillation teacher's params (placed already), likewise."""
        self.config = config
        self.mesh = mesh
        self.state_shardings = state_shardings
        self.state = place(state, state_shardings)
        self.frozen = None if frozen is None else place(frozen, frozen_shardings)
        self.teacher = teacher
        self.batch_keys = tuple(batch_keys)
        self.update_step = make_update_step(loss, config, mesh, state_shardings,
                                            compiler_options, frozen_shardings,
                                            None if teacher is None else teacher_shardings)
        self.np_rng = np.random.default_rng(config.seed)

    def run(self, samples: Sequence[Sample], learning_rates: np.ndarray
            ) -> tuple[list[dict[str, np.ndarray]], list[PackedBatch]]:
        cfg = self.config
        minibatches = split_minibatches(list(samples), cfg.mini_batch_size, cfg.ppo_epochs,
                                        self.np_rng, keep_groups=cfg.packing.keeps_groups)
        packed = pack_minibatches(minibatches, cfg.packing, mini_batch_size=cfg.mini_batch_size,
                                  rows_multiple=num_batch_shards(self.mesh))
        per_update = []
        for batch, lr in zip(packed, learning_rates, strict=True):
            arrays = put_batch(batch, self.batch_keys, self.mesh)
            extras = tuple(x for x in (self.frozen, self.teacher) if x is not None)
            self.state, metrics = self.update_step(self.state, arrays, lr, *extras)
            per_update.append(metrics)
        return jax.device_get(per_update), packed  # one host sync for the whole step


class EngineDriver:
    """Base of the host drivers that own an ``engine`` (:class:`UpdateEngine`): its train
    state (read and replaced, e.g. on restore), shardings, shuffle rng and parameters."""

    engine: UpdateEngine

    @property
    def state(self):
        return self.engine.state

    @state.setter
    def state(self, state) -> None:
        self.engine.state = state

    @property
    def state_shardings(self):
        return self.engine.state_shardings

    @property
    def np_rng(self) -> np.random.Generator:
        return self.engine.np_rng

    @property
    def params(self):
        return self.state.params


def applied(per_update: list[dict[str, np.ndarray]]) -> list[dict[str, np.ndarray]]:
    """The updates the non-finite guard kept."""
    return [m for m in per_update if int(m["nonfinite"]) == 0]


def mean_over_applied(per_update, names, prefix: str = "") -> dict[str, float]:
    """``{prefix + name: mean of metric name over applied updates}`` (NaN when none was
    applied: a skipped update's loss is NaN/inf and must not be averaged in)."""
    kept = applied(per_update)
    return {prefix + name: float(np.mean([float(m[name]) for m in kept])) if kept
            else float("nan") for name in names}
