"""The policy learner: its loss on a packed mini-batch, its train state, and its host step.

One ``train_step(state, batch, lr)`` = one optimizer update on one mini-batch, given as
``[n_micro, row_len]`` arrays (a :class:`~jaxrl_agentic.data.PackedBatch`'s token arrays);
the accumulation over micro-batches, the one division, the non-finite guard and the host
loop are ``update.py``'s. Per group of rows the policy contributes

    h          = model.hidden_states(tokens, positions, segment_ids)
    sums, D_m  = policy_loss(h, W, next tokens, ...), reduction denominator

**Next-token alignment.** ``old_logprobs[t]``, ``loss_mask[t]``, ``advantages[t]`` describe
token ``t``; its logprob comes from the hidden state at ``t − 1``. The step therefore shifts
the per-token arrays one place left ("prediction index" ``i`` = hidden ``i`` predicting
token ``i + 1``) and keeps prediction ``i`` only where tokens ``i`` and ``i + 1`` lie in the
same segment. That masks the last token of every segment (its "next token" belongs to the
next packed sample or is padding) and, equivalently, the first token of every segment
(nothing precedes it, so it can never be trained on).

**Only where the loss is.** The LM head (``[D, V]``, 136 M multiply-adds per position at
Qwen2.5-0.5B's 152 k vocabulary) runs only at the prediction indices that carry loss: the
batch's ``loss_index`` (``PackedBatch.loss_index``, ``[B, loss_slots]``, −1 = empty slot)
gathers those hidden states, targets and per-token inputs, and the fused logprob / loss
kernels see ``B · loss_slots`` positions instead of ``B · T``. Every other position has
loss weight 0, so the sums are unchanged; logprobs are returned scattered back to ``[B, T]``
(0 off the loss positions).

**Context parallelism.** On a mesh whose ``context`` axis has C > 1 devices, every
per-token input above is computed in packed order first (so the shift and the reductions
never meet a split); then the rows are laid out in zigzag order over the axis, and the
loss slots are each device's own (``context_rows``; ``forward_at_loss``).

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
from flax import nnx

from jaxrl_agentic.algos.kl import (
    KLControllerState,
    init_kl_controller,
    update_kl_controller,
)
from jaxrl_agentic.algos.losses import (
    PolicyLossSums,
    flat_segment_ids,
    policy_loss,
)
from jaxrl_agentic.algos.reductions import loss_denominator, loss_weights
from jaxrl_agentic.algos.teacher_divergence import teacher_divergence
from jaxrl_agentic.data import Sample, token_stats, updates_per_step
from jaxrl_agentic.models import lora
from jaxrl_agentic.models.transformer import in_compute_dtype
from jaxrl_agentic.runtime.parallel import (
    make_mesh,
    place,
    stacked_layer_dims,
    train_state_shardings,
)
from jaxrl_agentic.training import context_rows
from jaxrl_agentic.training.accumulation import accumulate_gradients
from jaxrl_agentic.training.learner_config import LearnerConfig
from jaxrl_agentic.training.off_policy import (
    logprob_mismatch,
    mask_out_of_support,
    mismatch_kl,
    out_of_support_tokens,
    sample_importance_weights,
)
from jaxrl_agentic.training.per_token import computed_slots, make_per_token, per_sample_outputs
from jaxrl_agentic.training.update import (
    EngineDriver,
    UpdateEngine,
    UpdateLoss,
    applied,
    check_learning_rates,
    init_optimizer_state,
    make_update_step,
    mean_over_applied,
)
from pallas_kernels import (
    compiler_options,
    restricted_token_logprobs,
    token_logprobs,
)

_F32 = jnp.float32
# Arrays of a PackedBatch the train step reads (ref_logprobs only when a reference is used).
TRAIN_BATCH_KEYS = (
    "tokens",
    "positions",
    "segment_ids",
    "loss_mask",
    "advantages",
    "old_logprobs",
    "loss_index",
)
LOGPROB_BATCH_KEYS = ("tokens", "positions", "segment_ids", "loss_index")
# One name per metric, from the loss sums (``PolicyLossSums``' fields) to the log, where the
# run puts it under ``actor/``: the sums divided by the reduction's denominator D, those
# divided by the loss-token count, and the update's own loss and gradient norm.
PER_DENOMINATOR = ("pg_loss", "kl", "entropy")
PER_TOKEN = ("clipfrac", "clipfrac_low", "clipfrac_high", "dual_clipfrac", "ratio",
             "approx_kl")
ACTOR_METRICS = ("loss", *PER_DENOMINATOR, *PER_TOKEN, "grad_norm")
# Samples whose sampler logprobs are compared with the learner's when the step does not
# recompute them anyway: a diagnostic, and a forward over the whole batch would cost a
# third of the learner's time.
MISMATCH_SAMPLES = 8


@flax.struct.dataclass
class TrainState:
    """Everything the train step reads and writes (a pytree; donated to the step).

    ``step``: updates attempted (one per ``train_step`` call); ``skipped``: of those, how
    many the non-finite guard dropped; ``rng``: advanced every update, so stochastic
    extensions get fresh randomness and a restored run replays it; ``ref_params``: frozen
    reference parameters, or None when no KL is used (or when LoRA's base, which the
    learner holds apart, is the reference). Under LoRA ``params`` are the adapters.
    """

    step: jax.Array
    skipped: jax.Array
    params: Any
    opt_state: Any
    kl: KLControllerState
    rng: jax.Array
    ref_params: Any = None


def full_params(params: Any, frozen: Any) -> Any:
    """The model's whole state: ``params``, plus the frozen base under LoRA."""
    return params if frozen is None else lora.combine(params, frozen)


def init_train_state(
    params: Any, config: LearnerConfig, *, ref_params: Any = None, ref_dtype=None,
    frozen: Any = None,
) -> TrainState:
    """Fresh state for ``params`` (an ``nnx.State``). Arrays are copied: the train step
    donates the state, and must not invalidate the caller's arrays.

    ``ref_params`` defaults to a copy of ``params`` when ``config.uses_reference``. With
    ``ref_dtype`` (the model's compute dtype), the reference's matrices are stored as the
    matmuls use them (``models.transformer.in_compute_dtype``): the reference only runs
    forwards, so its logprobs are unchanged, and with bf16 compute over fp32 params it takes
    half the memory (1 GB less at Qwen2.5-0.5B).

    ``frozen`` (LoRA's base; not part of the state): ``params`` are the adapters; the
    optimizer holds state for them only, and the reference is the base itself
    (``lora.base_only``), so none is stored.
    """
    params = jax.tree.map(jnp.copy, params)
    if config.uses_reference and frozen is None:
        source = params if ref_params is None else ref_params

        def stored(path, x):
            cast = x if ref_dtype is None else in_compute_dtype(x, ref_dtype,
                                                                stacked_layer_dims(path))
            return jnp.copy(x) if cast is x else cast  # never share a donated buffer

        ref_params = jax.tree_util.tree_map_with_path(stored, source)
    else:
        ref_params = None
    return TrainState(
        step=jnp.zeros((), jnp.int32),
        skipped=jnp.zeros((), jnp.int32),
        params=params,
        opt_state=init_optimizer_state(params, config),
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


def _hidden_and_head(graphdef, params, micro, remat: str = "none",
                     attention_impl: str = "auto", columns=None):
    # The head in the compute dtype, as the sampler (and `Transformer.logits`) use it: with
    # bf16 compute and fp32 params, an fp32 head here made the learner's logprobs differ from
    # the sampler's by the head's bf16 rounding (5e-3 mean at the Qwen2.5-0.5B shape).
    return nnx.merge(graphdef, params).hidden_and_head(
        micro["tokens"], micro["positions"], micro["segment_ids"], remat=remat,
        attention_impl=attention_impl, prefix_ids=micro.get("prefix_ids"), columns=columns)


def forward_at_loss(graphdef, config: LearnerConfig, params, micro):
    """``(hidden [N, D], head, take, valid [N], index)``: the forward of a group of rows and
    its hidden states at the N loss slots; ``take(x)`` picks a ``[B, T]`` prediction-index
    array at the same slots, ``valid`` is False on empty ones. On a mesh with a context axis
    the rows are laid out for it first (``context_rows``; ``index``: the slots in its shard
    rows), else the slots are the batch's ``loss_index`` (``index`` None)."""
    shards = context_rows.traced_context_size()
    if shards > 1:
        def run(laid, columns):
            return _hidden_and_head(graphdef, params, laid, config.remat,
                                    config.attention_impl, columns)
        return context_rows.forward_at_loss(run, micro, shards)
    hidden, head = _hidden_and_head(graphdef, params, micro, config.remat,
                                    config.attention_impl)
    take, valid = gather_loss_positions(micro)
    return take(hidden), head, take, valid, None


def gather_loss_positions(micro: dict[str, jax.Array]):
    """``(take, valid)`` for a group of rows: ``take(x)`` gathers ``x [B, T, ...]`` at the
    rows' ``loss_index`` slots into ``[B·S, ...]`` (S = loss slots); ``valid [B·S]`` is False
    on empty slots (their gathered values are position 0's: mask them)."""
    index = micro["loss_index"]
    valid = index >= 0
    safe = jnp.where(valid, index, 0)

    def take(x):
        picked = jnp.take_along_axis(x, safe.reshape(safe.shape + (1,) * (x.ndim - 2)), axis=1)
        return picked.reshape((-1,) + x.shape[2:])

    return take, valid.reshape(-1)


def micro_batch_sums(
    graphdef, config: LearnerConfig, params, micro: dict[str, jax.Array], kl_coef,
    teacher=None,
) -> tuple[PolicyLossSums, jax.Array]:
    """``(policy-loss sums, denominator)`` of one group of rows ``[B, T]`` (module doc).
    ``teacher``: ``(graphdef, params)`` of a distillation teacher whose divergence
    ``config.distill_loss`` joins the objective (``algos/teacher_divergence.py``)."""
    hidden, head, take, valid, _ = forward_at_loss(graphdef, config, params, micro)
    segment_ids = micro["segment_ids"]
    mask = _shift_left(micro["loss_mask"]) * next_token_valid(segment_ids)
    # Prediction i sits in token i's segment (= token i+1's wherever mask > 0).
    weights = loss_weights(mask, segment_ids, config.loss_reduction,
                           loss_norm_length=config.loss_norm_length)
    denominator = loss_denominator(mask, segment_ids, config.loss_reduction)
    ref = micro.get("ref_logprobs")
    at_loss = lambda x: take(_shift_left(x))  # noqa: E731
    top_k, top_p = config.logprob_filter
    sums = policy_loss(
        hidden,
        head,
        at_loss(micro["tokens"]),
        at_loss(micro["old_logprobs"]),
        at_loss(micro["advantages"]),
        jnp.where(valid, take(weights), 0.0),
        None if ref is None else at_loss(ref),
        temperature=config.temperature,
        clip_low=config.ratio_bounds[0],
        clip_high=config.ratio_bounds[1],
        dual_clip=config.dual_clip,
        kl_coef=kl_coef,
        kl_estimator=config.kl_estimator,
        entropy_coef=config.entropy_loss_coef,
        impl=config.kernel_impl,
        policy_loss=config.policy_loss,
        # Gathered slots keep each sample contiguous (increasing index); empty slots are 0.
        segment_ids=jnp.where(valid, take(flat_segment_ids(segment_ids).reshape(
            segment_ids.shape)), 0),
        top_k=top_k,
        top_p=top_p,
    )
    if teacher is not None:
        # The teacher reads the same rows and is gathered at the same loss slots.
        teacher_hidden, teacher_head, *_ = forward_at_loss(teacher[0], config, teacher[1], micro)
        divergence = teacher_divergence(hidden, head, teacher_hidden, teacher_head,
                                        kind=config.distill_loss,
                                        temperature=config.temperature)
        total = jnp.sum(divergence * jnp.where(valid, take(weights), 0.0))
        sums = sums._replace(objective=sums.objective + config.distill_coef * total,
                             teacher=total)
    return sums, denominator


def policy_update_loss(graphdef, config: LearnerConfig, teacher_graphdef=None) -> UpdateLoss:
    """The policy's part of an update (``update.UpdateLoss``): sums per group of rows, the
    objective ``pg + β·kl − c_H·entropy`` (``+ c_T·teacher`` with a teacher, whose params
    the update step passes in: ``teacher_graphdef`` is its graph), and the metrics
    ``pg_loss, kl, entropy`` (and ``teacher``) (÷ D),
    ``clipfrac, dual_clipfrac, ratio, approx_kl`` (÷ tokens), ``lr``-free ``kl_coef`` and
    ``tokens``. With the KL folded into the rewards the loss does not penalise it again."""

    def kl_coef(state):
        return jnp.zeros((), _F32) if config.kl_in_reward else state.kl.coef

    def micro_sums(params, micro, state, teacher_params=None):
        teacher = None if teacher_params is None else (teacher_graphdef, teacher_params)
        return micro_batch_sums(graphdef, config, params, micro, kl_coef(state), teacher)

    per_denominator = PER_DENOMINATOR + (("teacher",) if teacher_graphdef is not None else ())

    def metrics(state, sums, scale):
        per_token = 1.0 / jnp.maximum(sums.tokens, 1.0)
        out = {name: getattr(sums, name) * scale for name in per_denominator}
        out.update({name: getattr(sums, name) * per_token for name in PER_TOKEN})
        return {**out, "kl_coef": kl_coef(state), "tokens": sums.tokens}

    return UpdateLoss(
        micro_sums=micro_sums,
        objective=lambda sums: sums.objective,
        zero_sums=PolicyLossSums(*(jnp.zeros((), _F32) for _ in PolicyLossSums._fields)),
        metrics=metrics,
        advance=lambda state: {"rng": jax.random.split(state.rng)[0]},
    )


def make_loss_and_grads(graphdef, config: LearnerConfig, mesh=None):
    """``loss_and_grads(params, batch, kl_coef) -> (grads, sums, denominator)``: gradients of
    the mini-batch loss ``Σ objective / max(D, 1)`` (``accumulation.accumulate_gradients``; not
    jitted: tests jit it)."""
    zero_sums = PolicyLossSums(*(jnp.zeros((), _F32) for _ in PolicyLossSums._fields))

    def loss_and_grads(params, batch, kl_coef):
        def objective(p, micro):
            sums, denominator = micro_batch_sums(graphdef, config, p, micro, kl_coef)
            return sums.objective, (sums, denominator)

        return accumulate_gradients(objective, params, batch, zero_sums, mesh,
                                    config.packing.row_prefixes)

    return loss_and_grads


def make_train_step(graphdef, config: LearnerConfig, mesh, state_shardings,
                    compiler_options: dict | None = None):
    """Jitted ``train_step(state, batch, lr) -> (state, metrics)``: ``update.make_update_step``
    with the policy loss. ``batch``: ``TRAIN_BATCH_KEYS`` arrays (plus ``ref_logprobs`` when a
    reference is used); the state is donated."""
    return make_update_step(policy_update_loss(graphdef, config), config, mesh,
                            state_shardings, compiler_options)


def make_compute_logprobs(graphdef, config: LearnerConfig, mesh, param_shardings,
                          compiler_options: dict | None = None,
                          logprob_filter: tuple[int, float] | None = None, mark=None):
    """Jitted ``compute_logprobs(params, batch) -> [n_micro, row_len]`` fp32 token logprobs.

    Entry ``t`` is ``log π(token_t | tokens < t of its segment)`` at ``config.temperature``
    on the loss tokens (computed only there, module doc); 0 everywhere else. Used for the
    reference logprobs (with ``ref_params``, and ``logprob_filter=(0, 1.0)``: the full
    softmax) and for recomputed old logprobs, which are only read on loss tokens.
    ``logprob_filter``: ``(top_k, top_p)``, default ``config.logprob_filter``. ``batch``
    needs ``LOGPROB_BATCH_KEYS``; rows are scanned in groups of ``data · fsdp`` like the
    train step. ``mark(hidden, head, targets, logprobs) -> logprobs`` (optional) rewrites
    the gathered positions' logprobs in the same pass, from the same hidden states (the
    teacher's argmax mark, ``training/teacher.py``).
    """
    top_k, top_p = config.logprob_filter if logprob_filter is None else logprob_filter

    def rows_logprobs(params, micro):
        # With remat the train step's forward is a scan over the stacked blocks; so is this
        # one (the same program structure, and each block's weights are cast to the compute
        # dtype inside the loop instead of all of them up front).
        hidden, head, take, valid, index = forward_at_loss(graphdef, config, params, micro)
        b, t = micro["tokens"].shape
        args = (hidden, head, take(_shift_left(micro["tokens"])), config.temperature)
        if top_k > 0 or top_p < 1.0:
            logprobs = restricted_token_logprobs(*args, top_k=top_k, top_p=top_p)
        else:
            logprobs = token_logprobs(*args, impl=config.kernel_impl)
        if mark is not None:
            logprobs = mark(*args[:3], logprobs)
        if index is not None:  # context-parallel slots (`context_rows`)
            shards = context_rows.traced_context_size()
            return _shift_right(context_rows.scatter_to_rows(logprobs, index, shards, t))
        # Scatter back; empty slots write out of bounds and are dropped.
        index = jnp.where(valid, micro["loss_index"].reshape(-1), t).reshape(b, -1)
        rows = jnp.broadcast_to(jnp.arange(b)[:, None], index.shape)
        out = jnp.zeros((b, t), _F32).at[rows, index].set(
            logprobs.reshape(b, -1).astype(_F32), mode="drop")
        return _shift_right(out)

    return make_per_token(rows_logprobs, config.packing.batch_keys(LOGPROB_BATCH_KEYS), mesh,
                          param_shardings,
                          config.packing.row_prefixes, compiler_options)


# ----------------------------------------------------------------------------- host side


class Learner(EngineDriver):
    """Host driver of one pipeline step: samples in, ``ppo_epochs · ceil(n / mini_batch)``
    optimizer updates, metrics out.

    ``step(samples, learning_rates)``: compare the sampler's logprobs with the learner's
    (``rollout/logprob_mismatch``; all samples when they are recomputed as the old policy,
    else the first ``MISMATCH_SAMPLES``), fill reference logprobs with the frozen reference,
    run the updates (``update.UpdateEngine``), then advance the KL controller. The current
    parameters are ``learner.params``.
    """

    def __init__(self, graphdef, params, config: LearnerConfig, mesh=None, *,
                 ref_params: Any = None, frozen: Any = None, teacher=None):
        """``frozen``: with LoRA, ``params`` are the adapters and ``frozen`` the base;
        ``teacher``: a distillation teacher (``training.teacher.Teacher``, on ``mesh``),
        needed by a ``config.distill_loss`` divergence and read by every update."""
        if config.uses_teacher != (teacher is not None):
            raise ValueError("distill_loss: a divergence needs a teacher and a teacher "
                             "passed to the learner needs a divergence (got "
                             f"{config.distill_loss!r}, teacher "
                             f"{'given' if teacher is not None else 'None'})")
        self.config = config
        self.graphdef = graphdef
        self.mesh = make_mesh() if mesh is None else mesh
        dtype = nnx.merge(graphdef, full_params(params, frozen)).cfg.dtype
        state = init_train_state(params, config, ref_params=ref_params, ref_dtype=dtype,
                                 frozen=frozen)
        shardings = train_state_shardings(state, self.mesh)
        frozen_shardings = None if frozen is None else train_state_shardings(frozen, self.mesh)
        model_shardings = full_params(shardings.params, frozen_shardings)
        batch_keys = config.packing.batch_keys(
            TRAIN_BATCH_KEYS + (("ref_logprobs",) if config.uses_reference else ()))
        # In bf16 on CPU these programs are compiled as the sampler's are (`_same_bits`), so
        # the recomputed logprobs are the sampler's to float32 noise.
        options = compiler_options(dtype)
        # The base is copied once (the caller's arrays stay valid) and never donated.
        loss = policy_update_loss(graphdef, config,
                                  None if teacher is None else teacher.graphdef)
        self.engine = UpdateEngine(state, loss, config,
                                   self.mesh, shardings, batch_keys, options,
                                   frozen=None if frozen is None else jax.tree.map(jnp.copy,
                                                                                   frozen),
                                   frozen_shardings=frozen_shardings,
                                   teacher=None if teacher is None else teacher.params,
                                   teacher_shardings=None if teacher is None
                                   else teacher.shardings)
        self.compute_logprobs = make_compute_logprobs(graphdef, config, self.mesh,
                                                      model_shardings, options)
        self.compute_ref_logprobs = self.compute_logprobs
        if config.logprob_filter != (0, 1.0):
            self.compute_ref_logprobs = make_compute_logprobs(
                graphdef, config, self.mesh, model_shardings, options, logprob_filter=(0, 1.0))

    @property
    def params(self):
        """The policy's whole state (under LoRA: base and adapters, no array copied)."""
        return full_params(self.state.params, self.engine.frozen)

    @property
    def reference_params(self):
        """The reference policy's state: the stored reference, or under LoRA the base (the
        adapters with B = 0 on the frozen weights); None when the config uses no KL."""
        if self.engine.frozen is not None and self.config.uses_reference:
            return lora.combine(lora.base_only(self.state.params, self.engine.frozen),
                               self.engine.frozen)
        return self.state.ref_params

    # ---- logprobs -------------------------------------------------------------------------
    def sample_logprobs(self, samples: Sequence[Sample], *, reference: bool = False):
        """Per-sample ``[len(sample)]`` logprobs under the current (or reference) params;
        0 on each sample's first token and beyond ``sequence_length`` (truncated).

        The reference's are always those of its full softmax: under
        ``logprob_under_sampling_filter`` a token the policy drew may lie outside the
        reference's own top-k/top-p set, and a sentinel there is no logprob to take a KL of.
        """
        if reference:
            params, compute = self.reference_params, self.compute_ref_logprobs
        else:
            params, compute = self.params, self.compute_logprobs
        if params is None:
            raise ValueError("no reference parameters: the config uses no KL")
        return per_sample_outputs(samples, self.config.packing, self.mesh,
                                  compute, params,
                                  self.config.packing.batch_keys(LOGPROB_BATCH_KEYS))

    def fill_ref_logprobs(self, samples: Sequence[Sample]) -> list[Sample]:
        """Samples with ``ref_logprobs`` from the frozen reference (on generated tokens)."""
        ref = self.sample_logprobs(samples, reference=True)
        return [
            dataclasses.replace(s, ref_logprobs=np.where(s.loss_mask > 0, r, 0.0))
            for s, r in zip(samples, ref, strict=True)
        ]

    def _old_logprobs(self, samples: list[Sample]) -> tuple[list[Sample], dict[str, float]]:
        """The samples the updates use as π_old, and the off-policy metrics."""
        cfg = self.config
        cut = cfg.packing.sequence_length
        checked = samples if cfg.recompute_old_logprobs else samples[:MISMATCH_SAMPLES]
        recomputed = self.sample_logprobs(checked)
        extra = {"rollout/logprob_mismatch": logprob_mismatch(checked, recomputed, cut),
                 "off_policy/mismatch_kl": mismatch_kl(checked, recomputed, cut)}
        if cfg.restricts_support:
            extra["rollout/out_of_support_tokens"] = float(
                out_of_support_tokens(checked, recomputed, cut))
        # A π_old that is the out-of-support sentinel (a top-k/top-p logprob of a token
        # outside the kept set, on either side) would make that token's ratio e^20: masked.
        if not cfg.recompute_old_logprobs:
            return mask_out_of_support(samples), extra
        if cfg.tis_imp_ratio_cap > 0:
            weights, tis_stats = sample_importance_weights(samples, recomputed, cfg)
            samples = [dataclasses.replace(
                s, advantages=np.where(s.loss_mask > 0, s.advantages * w, s.advantages)
                .astype(np.float32)) for s, w in zip(samples, weights, strict=True)]
            extra.update(tis_stats)
        samples = mask_out_of_support(samples, recomputed)
        samples = [dataclasses.replace(s, old_logprobs=np.where(s.loss_mask > 0, r, 0.0))
                   for s, r in zip(samples, recomputed, strict=True)]
        return samples, extra

    # ---- one pipeline step ----------------------------------------------------------------
    def step(self, samples: Sequence[Sample], learning_rates: Sequence[float]) -> dict:
        """Runs the updates of one pipeline step; returns host-side float metrics."""
        cfg = self.config
        if not samples:
            raise ValueError("Learner.step got no samples")
        lrs = check_learning_rates(learning_rates, len(samples), cfg, "learner")
        samples, extra = self._old_logprobs(list(samples))
        if cfg.uses_reference:
            if any(s.ref_logprobs is None for s in samples):
                samples = self.fill_ref_logprobs(samples)
        else:
            samples = [dataclasses.replace(s, ref_logprobs=None) for s in samples]

        per_update, packed = self.engine.run(samples, lrs)
        names = ACTOR_METRICS + (("teacher",) if cfg.uses_teacher else ())
        out = mean_over_applied(per_update, names, prefix="actor/")
        applied_kl = [float(m["kl"]) for m in applied(per_update)]
        if self.state.kl.adaptive and applied_kl:
            # Sequence-level KL for seq_mean_token_sum, per-token otherwise (the reduction's).
            kl_state = update_kl_controller(self.state.kl, np.mean(applied_kl), len(samples))
            self.state = self.state.replace(kl=place(kl_state, self.state_shardings.kl))

        stats = [token_stats(b) for b in packed]
        out.update(
            {
                "kl/coef": float(self.state.kl.coef),
                "optim/lr": float(np.mean(lrs)),
                "optim/num_updates": float(self.state.step),
                "optim/updates_this_step": float(
                    updates_per_step(len(samples), cfg.mini_batch_size, cfg.ppo_epochs)),
                "optim/nonfinite_updates": float(sum(int(m["nonfinite"]) for m in per_update)),
                # The samples' tokens, whatever the layout computed of them: tree packing
                # computes a group's shared prompt once (tokens/shared_saved fewer).
                "tokens/real": sum(s["real_tokens"] + s["shared_saved"] for s in stats),
                "tokens/shared_saved": sum(s["shared_saved"] for s in stats),
                "tokens/loss": float(sum(float(m["tokens"]) for m in per_update)),
                "tokens/computed": float(sum(computed_slots(b, self.mesh, cfg.packing.row_prefixes)
                                             for b in packed)),
                "batch/num_samples": float(len(samples)),
                "batch/num_micro_batches": float(packed[0].num_micro_batches),
                "batch/max_micro_batch_tokens": max(
                    s["max_micro_batch_real_tokens"] for s in stats
                ),
                "batch/padded_seq_len": float(packed[0].row_len),
                "batch/num_truncated": float(
                    sum(len(s) > cfg.packing.sequence_length for s in samples)
                ),
                **extra,
            }
        )
        out["tokens/efficiency"] = out["tokens/real"] / max(out["tokens/computed"], 1.0)
        return out
