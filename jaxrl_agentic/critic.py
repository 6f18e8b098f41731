"""The GAE critic: a value model trained alongside the policy, and GAE samples from it.

The critic is a :class:`~jaxrl_agentic.models.value.ValueModel` whose backbone starts as a
copy of the policy's and whose scalar head starts at zero. It lives in its own train state
(parameters + AdamW) on the policy learner's mesh and is trained on the same packed
``[n_micro, row_len]`` batches.

**Alignment.** ``ValueModel.values[t]`` is the value *after reading* token ``t``. The value
that belongs to token ``k`` is the value of the state ``k`` was generated in,

    V_k = values_after[k − 1]          (0 on the first token of each packed segment)

so ``V``, ``returns`` and ``loss_mask`` are all indexed by the token itself. In a packed row
the shift must not cross segments: the first token of a segment would otherwise receive the
last value of the previous sample.

**One update** (``make_critic_train_step``) on one mini-batch, reduction ``token_mean``:

    for each group of micro-batch rows (lax.scan):           # fp32 accumulators
        V       = shifted values of the rows (above)
        ℓ_k     = ½·max((V_k − R_k)², (clip(V_k, V_old,k ± ε_v) − R_k)²)    (ε_v = value_clip)
        G      += ∇_θ Σ_k m_k·ℓ_k;     D += Σ_k m_k
    g = G / max(D, 1)                                        # the one division
    g = clip_by_global_norm(g, max_grad_norm);  θ ← AdamW(θ, g, lr)

``m`` is the loss mask restricted to tokens that have a predecessor in their segment.
``value_clip=None`` gives the plain ``½(V − R)²``.

**GAE samples** (:func:`gae_samples`): the critic's ``V`` on each trajectory sample, then
``algos.advantages.token_advantages(adv_estimator="gae")``:

    δ_k = r_k + γ·V_{k'} − V_k,    A_k = δ_k + γλ·A_{k'},    R_k = A_k + V_k

over generated tokens in order (``k'`` = the next generated token; ``V`` after the last is 0).
The samples carry ``advantages = A``, ``returns = R`` and ``values = V`` (the old values for
clipping), all 0 off the loss mask.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from typing import Any, NamedTuple

import flax.struct
import jax
import jax.numpy as jnp
import numpy as np
import optax
from flax import nnx
from jax import lax

from jaxrl_agentic.algos.advantages import token_advantages
from jaxrl_agentic.algos.losses import value_loss
from jaxrl_agentic.data import (
    Sample,
    pack_minibatches,
    split_minibatches,
    updates_per_step,
)
from jaxrl_agentic.data.samples import trajectory_sample
from jaxrl_agentic.learner import (
    _constrain_rows,
    _micro_groups,
    _strong_types,
    accumulate_gradients,
    apply_if_finite,
    make_optimizer,
    pad_to_shards,
    per_sample_outputs,
    put_batch,
    set_learning_rate,
)
from jaxrl_agentic.models.value import ValueModel, state_values
from jaxrl_agentic.parallel import (
    batch_sharding,
    make_mesh,
    num_batch_shards,
    place,
    replicated,
    train_state_shardings,
)

_F32 = jnp.float32
CRITIC_BATCH_KEYS = ("tokens", "positions", "segment_ids", "loss_mask", "returns", "values")
VALUE_BATCH_KEYS = ("tokens", "positions", "segment_ids")


@dataclasses.dataclass(frozen=True)
class CriticConfig:
    """Optimizer, loss and packing settings of the critic.

    ``value_clip``: ε_v of the clipped value loss (None = unclipped ``½(V − R)²``).
    Mini-batches, epochs and packing work as in :class:`~jaxrl_agentic.learner.LearnerConfig`;
    the loss reduction is ``token_mean``.
    """

    learning_rate: float = 1e-5
    max_grad_norm: float | None = 1.0
    value_clip: float | None = 0.2
    mini_batch_size: int = 8
    ppo_epochs: int = 1
    micro_batch_max_tokens: int = 4096
    sequence_length: int = 4096
    seed: int = 0
    weight_decay: float = 0.0
    rows_bucket: int = 0
    pad_token_id: int = 0
    adam_b1: float = 0.9
    adam_b2: float = 0.999
    adam_eps: float = 1e-8

    def __post_init__(self):
        checks = [
            (self.learning_rate >= 0, "learning_rate must be >= 0"),
            (self.max_grad_norm is None or self.max_grad_norm > 0, "max_grad_norm must be > 0"),
            (self.value_clip is None or self.value_clip > 0, "value_clip must be > 0"),
            (self.mini_batch_size >= 1 and self.ppo_epochs >= 1,
             "need mini_batch_size, ppo_epochs >= 1"),
            (self.micro_batch_max_tokens >= self.sequence_length >= 1,
             "need micro_batch_max_tokens >= sequence_length >= 1"),
        ]
        for ok, message in checks:
            if not ok:
                raise ValueError(f"CriticConfig: {message} (got {self})")


@flax.struct.dataclass
class CriticState:
    """The critic's train state (a pytree; donated to the step). ``step``: updates attempted;
    ``skipped``: of those, how many the non-finite guard dropped."""

    step: jax.Array
    skipped: jax.Array
    params: Any
    opt_state: Any


def make_critic_optimizer(config: CriticConfig) -> optax.GradientTransformation:
    """The policy's optimizer (``learner.make_optimizer``: clip by global norm ∘ AdamW with
    the LR in its state) built from the critic's own settings, which use the same names."""
    return make_optimizer(config)


def value_model_from_policy(graphdef, params, *, seed: int = 0) -> ValueModel:
    """A ValueModel whose backbone is the policy ``Transformer`` (graphdef, params) and whose
    head is zero-initialised. The backbone arrays are shared, not copied."""
    backbone = nnx.merge(graphdef, params)
    return ValueModel(backbone.cfg, rngs=nnx.Rngs(seed), backbone=backbone)


def init_critic_state(params: Any, config: CriticConfig) -> CriticState:
    """Fresh state for ValueModel ``params``; arrays are copied (the step donates them)."""
    params = jax.tree.map(jnp.copy, params)
    opt_state = make_critic_optimizer(config).init(params)
    opt_state = set_learning_rate(opt_state, config.learning_rate)
    return CriticState(
        step=jnp.zeros((), jnp.int32),
        skipped=jnp.zeros((), jnp.int32),
        params=params,
        opt_state=_strong_types(opt_state),
    )


# ----------------------------------------------------------------------------- the math


def _previous(x: jax.Array) -> jax.Array:
    """``y[:, k] = x[:, k − 1]``, first column 0."""
    return jnp.concatenate([jnp.zeros_like(x[:, :1]), x[:, :-1]], axis=1)


def has_predecessor(segment_ids: jax.Array) -> jax.Array:
    """``[B, T]`` bool: token ``k − 1`` lies in token ``k``'s (non-padding) segment."""
    return (segment_ids > 0) & (segment_ids == _previous(segment_ids))


def packed_state_values(graphdef, params, micro: dict[str, jax.Array]) -> jax.Array:
    """``[B, T]`` fp32 ``V_k = values_after[k − 1]`` within each segment, 0 on a segment's
    first token and on padding (module doc)."""
    model = nnx.merge(graphdef, params)
    after = model.values(micro["tokens"], micro["positions"], micro["segment_ids"])
    return jnp.where(has_predecessor(micro["segment_ids"]), state_values(after), 0.0)


class ValueLossSums(NamedTuple):
    """Scalar fp32 sums over the loss tokens of one micro-batch (``token_mean`` weights).

    ``loss_sum`` = Σ m·ℓ carries the gradient; the others are diagnostics: Σ m·V, Σ m·R,
    Σ m·R², Σ m·(R − V), Σ m·(R − V)², ``clipped`` = #{clipped branch strictly larger},
    ``num_tokens`` = Σ m (= the token_mean denominator).
    """

    loss_sum: jax.Array
    values: jax.Array
    returns: jax.Array
    returns_sq: jax.Array
    error: jax.Array
    error_sq: jax.Array
    clipped: jax.Array
    num_tokens: jax.Array


def micro_batch_value_sums(
    graphdef, config: CriticConfig, params, micro: dict[str, jax.Array]
) -> tuple[ValueLossSums, jax.Array]:
    """``(value-loss sums, denominator)`` of one group of rows ``[B, T]`` (module doc)."""
    values = packed_state_values(graphdef, params, micro)
    segment_ids = micro["segment_ids"]
    mask = micro["loss_mask"].astype(_F32) * has_predecessor(segment_ids)
    returns, old = micro["returns"].astype(_F32), micro["values"].astype(_F32)
    loss, denominator = value_loss(
        values, old, returns, mask, segment_ids, "token_mean", clip_eps=config.value_clip
    )
    v = lax.stop_gradient(values)
    on = mask > 0
    masked_sum = lambda x: jnp.sum(jnp.where(on, x, 0.0))  # noqa: E731
    if config.value_clip is None:
        clipped = jnp.zeros((), _F32)
    else:
        v_clip = jnp.clip(v, old - config.value_clip, old + config.value_clip)
        clipped = masked_sum(
            (jnp.square(v_clip - returns) > jnp.square(v - returns)).astype(_F32)
        )
    sums = ValueLossSums(
        loss_sum=loss,
        values=masked_sum(v),
        returns=masked_sum(returns),
        returns_sq=masked_sum(jnp.square(returns)),
        error=masked_sum(returns - v),
        error_sq=masked_sum(jnp.square(returns - v)),
        clipped=clipped,
        num_tokens=masked_sum(jnp.ones_like(v)),
    )
    return sums, denominator


def make_value_loss_and_grads(graphdef, config: CriticConfig, mesh=None):
    """``loss_and_grads(params, batch) -> (grads, sums, denominator)``: gradients of the
    mini-batch value loss ``Σ m·ℓ / max(Σ m, 1)``, accumulated over micro-batch groups and
    divided once (``learner.accumulate_gradients``; not jitted)."""
    zero_sums = ValueLossSums(*(jnp.zeros((), _F32) for _ in ValueLossSums._fields))

    def loss_and_grads(params, batch):
        def objective(p, micro):
            sums, denominator = micro_batch_value_sums(graphdef, config, p, micro)
            return sums.loss_sum, (sums, denominator)

        batch = {k: batch[k] for k in CRITIC_BATCH_KEYS}
        return accumulate_gradients(objective, params, batch, zero_sums, mesh)

    return loss_and_grads


def make_critic_train_step(graphdef, config: CriticConfig, mesh, state_shardings):
    """Jitted ``train_step(state, batch, lr) -> (state, metrics)``: one AdamW update of the
    critic on one mini-batch (``CRITIC_BATCH_KEYS`` arrays ``[n_micro, row_len]``), skipped
    when the loss or gradient norm is not finite. Metrics: ``loss`` (÷ D), ``grad_norm``
    (before clipping), ``nonfinite`` and the raw :class:`ValueLossSums` fields."""
    optimizer = make_critic_optimizer(config)
    loss_and_grads = make_value_loss_and_grads(graphdef, config, mesh)

    def train_step(state: CriticState, batch: dict[str, jax.Array], lr: jax.Array):
        grads, sums, denominator = loss_and_grads(state.params, batch)
        loss = sums.loss_sum / jnp.maximum(denominator, 1.0)
        params, opt_state, finite, grad_norm = apply_if_finite(
            optimizer, state.params, state.opt_state, grads, loss, lr
        )
        new_state = state.replace(
            step=state.step + 1,
            skipped=state.skipped + (~finite).astype(jnp.int32),
            params=params,
            opt_state=opt_state,
        )
        metrics = {
            "loss": loss,
            "grad_norm": grad_norm,
            "nonfinite": (~finite).astype(jnp.int32),
            **sums._asdict(),
        }
        return new_state, metrics

    repl = replicated(mesh)
    return jax.jit(
        train_step,
        in_shardings=(state_shardings, batch_sharding(mesh), repl),
        out_shardings=(state_shardings, repl),
        donate_argnums=0,
    )


def make_compute_values(graphdef, mesh, param_shardings):
    """Jitted ``compute_values(params, batch) -> [n_micro, row_len]`` fp32 ``V_k`` (module
    doc; 0 on each segment's first token and on padding), rows scanned in groups of
    ``data · fsdp`` like the train step."""
    group_rows = num_batch_shards(mesh)

    def compute_values(params, batch):
        def body(_, micro):
            return None, packed_state_values(graphdef, params, _constrain_rows(micro, mesh))

        batch = {k: batch[k] for k in VALUE_BATCH_KEYS}
        _, out = lax.scan(body, None, _micro_groups(batch, group_rows))
        return jnp.swapaxes(out, 0, 1).reshape(-1, out.shape[-1])

    return jax.jit(
        compute_values,
        in_shardings=(param_shardings, batch_sharding(mesh)),
        out_shardings=batch_sharding(mesh),
    )


# ----------------------------------------------------------------------------- host side


def _explained_variance(sums: dict[str, float]) -> float:
    """``1 − Var(R − V) / Var(R)`` over pooled loss tokens (NaN when Var(R) = 0)."""
    n = sums["num_tokens"]
    if n <= 0:
        return float("nan")
    var_r = sums["returns_sq"] / n - (sums["returns"] / n) ** 2
    var_e = sums["error_sq"] / n - (sums["error"] / n) ** 2
    return 1.0 - var_e / var_r if var_r > 0 else float("nan")


def _aggregate(per_update: list[dict[str, np.ndarray]]) -> dict[str, float]:
    """Step metrics from the applied updates: loss and grad norm averaged over updates; the
    value/return means, explained variance and clip fraction pooled over their tokens."""
    applied = [m for m in per_update if int(m["nonfinite"]) == 0]
    if not applied:
        nan = float("nan")
        return {f"critic/{k}": nan for k in ("value_loss", "values_mean", "returns_mean",
                                             "explained_variance", "grad_norm", "clipfrac")}
    pooled = {k: sum(float(m[k]) for m in applied) for k in ValueLossSums._fields}
    n = max(pooled["num_tokens"], 1.0)
    return {
        "critic/value_loss": float(np.mean([float(m["loss"]) for m in applied])),
        "critic/values_mean": pooled["values"] / n,
        "critic/returns_mean": pooled["returns"] / n,
        "critic/explained_variance": _explained_variance(pooled),
        "critic/grad_norm": float(np.mean([float(m["grad_norm"]) for m in applied])),
        "critic/clipfrac": pooled["clipped"] / n,
    }


class Critic:
    """Host driver of the critic: values for GAE, and ``ppo_epochs · ceil(n / mini_batch)``
    value-loss updates per pipeline step.

    ``Critic(graphdef, params, config, mesh)`` takes the *policy* ``Transformer``'s graphdef
    and params: the backbone starts as a copy of them, the value head at zero. The critic's
    own (ValueModel) graphdef and params are ``critic.graphdef`` / ``critic.params``.
    """

    def __init__(self, graphdef, params, config: CriticConfig, mesh=None):
        self.config = config
        self.mesh = make_mesh() if mesh is None else mesh
        self.graphdef, value_params = nnx.split(
            value_model_from_policy(graphdef, params, seed=config.seed)
        )
        state = init_critic_state(value_params, config)
        self.state_shardings = train_state_shardings(state, self.mesh)
        self.state = place(state, self.state_shardings)
        self.train_step = make_critic_train_step(
            self.graphdef, config, self.mesh, self.state_shardings
        )
        self.compute_values = make_compute_values(
            self.graphdef, self.mesh, self.state_shardings.params
        )
        self.np_rng = np.random.default_rng(config.seed)

    @property
    def params(self):
        return self.state.params

    # ---- values -----------------------------------------------------------------------------
    def sample_values(self, samples: Sequence[Sample]) -> list[np.ndarray]:
        """Per-sample ``[len(sample)]`` fp32 ``V_k`` (the value of the state token ``k`` was
        generated in); 0 on each sample's first token and beyond ``sequence_length``."""
        return per_sample_outputs(samples, self.config, self.mesh, self.compute_values,
                                  self.state.params, VALUE_BATCH_KEYS)

    # ---- one pipeline step ------------------------------------------------------------------
    def step(
        self, samples: Sequence[Sample], learning_rate: float | Sequence[float] | None = None
    ) -> dict[str, float]:
        """Value-loss updates on ``samples`` (which carry ``returns`` and old ``values``).

        ``learning_rate``: one LR for every update, one per update
        (``updates_per_step(len(samples), mini_batch_size, ppo_epochs)`` of them), or None
        for ``config.learning_rate``. Returns host-side ``critic/*`` metrics.
        """
        cfg = self.config
        if not samples:
            raise ValueError("Critic.step got no samples")
        if any(s.returns is None or s.values is None for s in samples):
            raise ValueError("Critic.step needs samples with returns and values (gae_samples)")
        num_updates = updates_per_step(len(samples), cfg.mini_batch_size, cfg.ppo_epochs)
        lr = cfg.learning_rate if learning_rate is None else learning_rate
        lrs = np.asarray(lr, np.float32).reshape(-1)
        if lrs.size == 1:
            lrs = np.full(num_updates, lrs[0], np.float32)
        if lrs.shape != (num_updates,):
            raise ValueError(
                f"{len(samples)} samples make {num_updates} critic updates but {lrs.size} "
                "learning rates were given"
            )
        minibatches = split_minibatches(
            list(samples), cfg.mini_batch_size, cfg.ppo_epochs, self.np_rng
        )
        packed = pack_minibatches(
            minibatches,
            micro_batch_max_tokens=cfg.micro_batch_max_tokens,
            sequence_length=cfg.sequence_length,
            rows_bucket=cfg.rows_bucket,
            pad_token_id=cfg.pad_token_id,
        )
        per_update = []
        for batch, lr_i in zip(packed, lrs, strict=True):
            arrays = put_batch(pad_to_shards(batch, self.mesh, cfg.pad_token_id),
                               CRITIC_BATCH_KEYS, self.mesh)
            self.state, metrics = self.train_step(self.state, arrays, lr_i)
            per_update.append(metrics)
        per_update = jax.device_get(per_update)
        out = _aggregate(per_update)
        out["critic/lr"] = float(np.mean(lrs))
        out["critic/nonfinite_updates"] = float(sum(int(m["nonfinite"]) for m in per_update))
        return out


def gae_samples(
    trajectories, critic: Critic, *, gamma: float, lambd: float
) -> tuple[list[Sample], dict[str, float]]:
    """Trajectory samples with GAE advantages, returns and old values (module doc).

    Trajectories without turns give no sample (the rest keep their order). Values are the
    critic's ``V_k`` on each trajectory sample, so tokens cut off by ``sequence_length`` have
    ``V = 0`` there. Metrics (over loss tokens): ``critic/rollout_values_mean``,
    ``critic/rollout_returns_mean``, ``critic/rollout_explained_variance`` (of the old values
    for the GAE returns) and ``critic/gae_advantages_mean``.
    """
    trajectories = [t for t in trajectories if t.turns]
    if not trajectories:
        return [], {}
    base = [trajectory_sample(t, 0.0) for t in trajectories]
    values = critic.sample_values(base)
    advantages, returns = token_advantages(
        trajectories, adv_estimator="gae", gamma=gamma, lambd=lambd, values=values
    )
    samples = []
    for traj, a, r, v in zip(trajectories, advantages, returns, values, strict=True):
        sample = trajectory_sample(traj, a, token_level=True, returns=r)
        samples.append(dataclasses.replace(sample, values=v * sample.loss_mask))
    on = [s.loss_mask > 0 for s in samples]
    v_all = np.concatenate([s.values[m] for s, m in zip(samples, on, strict=True)])
    r_all = np.concatenate([s.returns[m] for s, m in zip(samples, on, strict=True)])
    a_all = np.concatenate([s.advantages[m] for s, m in zip(samples, on, strict=True)])
    if not r_all.size:
        return samples, {}
    var_r = float(np.var(r_all))
    metrics = {
        "critic/rollout_values_mean": float(v_all.mean()),
        "critic/rollout_returns_mean": float(r_all.mean()),
        "critic/rollout_explained_variance": (
            1.0 - float(np.var(r_all - v_all)) / var_r if var_r > 0 else float("nan")
        ),
        "critic/gae_advantages_mean": float(a_all.mean()),
    }
    return samples, metrics
