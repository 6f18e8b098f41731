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

**One update** (``make_critic_train_step``: ``update.make_update_step`` with this loss) on
one mini-batch, reduction ``token_mean``; per group of rows the critic contributes

    V       = shifted values of the rows (above)
    ℓ_k     = ½·max((V_k − R_k)², (clip(V_k, V_old,k ± ε_v) − R_k)²)    (ε_v = value_clip)
    sum    = Σ_k m_k·ℓ_k;     D = Σ_k m_k

``m`` is the loss mask restricted to tokens that have a predecessor in their segment.
``value_clip=None`` gives the plain ``½(V − R)²``.

**GAE.** The critic supplies ``V`` on each trajectory sample (:meth:`Critic.sample_values`);
the advantages, returns and samples come from ``algos.advantages.token_advantages`` and
``data.samples.build_samples`` like every other estimator's (``pipeline.Pipeline``).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from typing import Any, NamedTuple

import flax.struct
import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx
from jax import lax

from jaxrl_agentic.algos.losses import value_loss
from jaxrl_agentic.data import Sample, updates_per_step
from jaxrl_agentic.models.value import ValueModel, state_values
from jaxrl_agentic.runtime.parallel import make_mesh, train_state_shardings
from jaxrl_agentic.training.accumulation import accumulate_gradients
from jaxrl_agentic.training.per_token import make_per_token, per_sample_outputs
from jaxrl_agentic.training.update import (
    EngineDriver,
    UpdateConfig,
    UpdateEngine,
    UpdateLoss,
    applied,
    check_learning_rates,
    fail_first,
    init_optimizer_state,
    make_update_step,
)

_F32 = jnp.float32
CRITIC_BATCH_KEYS = ("tokens", "positions", "segment_ids", "loss_mask", "returns", "values")
VALUE_BATCH_KEYS = ("tokens", "positions", "segment_ids")


@dataclasses.dataclass(frozen=True)
class CriticConfig(UpdateConfig):
    """The critic's settings: the shared optimizer/packing ones (its own learning rate, the
    run's ``critic_learning_rate``) and ``value_clip``, ε_v of the clipped value loss (None =
    unclipped ``½(V − R)²``). The loss reduction is ``token_mean``."""

    value_clip: float | None = 0.2

    def __post_init__(self):
        super().__post_init__()
        fail_first([(self.value_clip is None or self.value_clip > 0, "value_clip",
                     "must be > 0")], self)


@flax.struct.dataclass
class CriticState:
    """The critic's train state (a pytree; donated to the step). ``step``: updates attempted;
    ``skipped``: of those, how many the non-finite guard dropped."""

    step: jax.Array
    skipped: jax.Array
    params: Any
    opt_state: Any


def value_model_from_policy(graphdef, params, *, seed: int = 0) -> ValueModel:
    """A ValueModel whose backbone is the policy ``Transformer`` (graphdef, params) and whose
    head is zero-initialised. The backbone arrays are shared, not copied."""
    backbone = nnx.merge(graphdef, params)
    return ValueModel(backbone.cfg, rngs=nnx.Rngs(seed), backbone=backbone)


def init_critic_state(params: Any, config: CriticConfig) -> CriticState:
    """Fresh state for ValueModel ``params``; arrays are copied (the step donates them)."""
    params = jax.tree.map(jnp.copy, params)
    return CriticState(
        step=jnp.zeros((), jnp.int32),
        skipped=jnp.zeros((), jnp.int32),
        params=params,
        opt_state=init_optimizer_state(params, config),
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
    after = model.values(micro["tokens"], micro["positions"], micro["segment_ids"],
                         micro.get("prefix_ids"))
    return jnp.where(has_predecessor(micro["segment_ids"]), state_values(after), 0.0)


class ValueLossSums(NamedTuple):
    """Scalar fp32 sums over the loss tokens of one micro-batch (``token_mean`` weights).

    ``loss_sum`` = Σ m·ℓ carries the gradient; the others are diagnostics: Σ m·V, Σ m·R,
    Σ m·R², Σ m·(R − V), Σ m·(R − V)², ``clipfrac`` = #{clipped branch strictly larger}
    (÷ ``tokens`` for ``critic/clipfrac``), ``tokens`` = Σ m (= the token_mean denominator).
    """

    loss_sum: jax.Array
    values: jax.Array
    returns: jax.Array
    returns_sq: jax.Array
    error: jax.Array
    error_sq: jax.Array
    clipfrac: jax.Array
    tokens: jax.Array


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
        clipfrac=clipped,
        tokens=masked_sum(jnp.ones_like(v)),
    )
    return sums, denominator


def value_update_loss(graphdef, config: CriticConfig) -> UpdateLoss:
    """The critic's part of an update (``update.UpdateLoss``): the value-loss sums per group
    of rows; metrics are the raw :class:`ValueLossSums` fields (pooled on the host)."""
    return UpdateLoss(
        micro_sums=lambda params, micro, state: micro_batch_value_sums(graphdef, config,
                                                                       params, micro),
        objective=lambda sums: sums.loss_sum,
        zero_sums=ValueLossSums(*(jnp.zeros((), _F32) for _ in ValueLossSums._fields)),
        metrics=lambda state, sums, scale: sums._asdict(),
    )


def make_value_loss_and_grads(graphdef, config: CriticConfig, mesh=None):
    """``loss_and_grads(params, batch) -> (grads, sums, denominator)``: gradients of the
    mini-batch value loss ``Σ m·ℓ / max(Σ m, 1)`` (``accumulation.accumulate_gradients``; not
    jitted)."""
    loss = value_update_loss(graphdef, config)

    def loss_and_grads(params, batch):
        def objective(p, micro):
            sums, denominator = loss.micro_sums(p, micro, None)
            return loss.objective(sums), (sums, denominator)

        batch = {k: batch[k] for k in config.packing.batch_keys(CRITIC_BATCH_KEYS)}
        return accumulate_gradients(objective, params, batch, loss.zero_sums, mesh,
                                    config.packing.row_prefixes)

    return loss_and_grads


def make_critic_train_step(graphdef, config: CriticConfig, mesh, state_shardings):
    """Jitted ``train_step(state, batch, lr) -> (state, metrics)``: one AdamW update of the
    critic on one mini-batch (``CRITIC_BATCH_KEYS`` arrays ``[n_micro, row_len]``)."""
    return make_update_step(value_update_loss(graphdef, config), config, mesh,
                            state_shardings)


def make_compute_values(graphdef, mesh, param_shardings, halvings: int = 0,
                        keys=VALUE_BATCH_KEYS):
    """Jitted ``compute_values(params, batch) -> [n_micro, row_len]`` fp32 ``V_k`` (module
    doc; 0 on each segment's first token and on padding), rows scanned in groups of
    ``data · fsdp`` like the train step (each on its prefix: ``halvings`` =
    ``PackingConfig.row_prefixes``)."""
    return make_per_token(lambda params, micro: packed_state_values(graphdef, params, micro),
                          keys, mesh, param_shardings, halvings)


# ----------------------------------------------------------------------------- host side


def _explained_variance(sums: dict[str, float]) -> float:
    """``1 − Var(R − V) / Var(R)`` over pooled loss tokens (NaN when Var(R) = 0)."""
    n = sums["tokens"]
    if n <= 0:
        return float("nan")
    var_r = sums["returns_sq"] / n - (sums["returns"] / n) ** 2
    var_e = sums["error_sq"] / n - (sums["error"] / n) ** 2
    return 1.0 - var_e / var_r if var_r > 0 else float("nan")


def _aggregate(per_update: list[dict[str, np.ndarray]]) -> dict[str, float]:
    """Step metrics from the applied updates: loss and grad norm averaged over updates; the
    value/return means, explained variance and clip fraction pooled over their tokens."""
    kept = applied(per_update)
    if not kept:
        nan = float("nan")
        return {f"critic/{k}": nan for k in ("value_loss", "values_mean", "returns_mean",
                                             "explained_variance", "grad_norm", "clipfrac")}
    pooled = {k: sum(float(m[k]) for m in kept) for k in ValueLossSums._fields}
    n = max(pooled["tokens"], 1.0)
    return {
        "critic/value_loss": float(np.mean([float(m["loss"]) for m in kept])),
        "critic/values_mean": pooled["values"] / n,
        "critic/returns_mean": pooled["returns"] / n,
        "critic/explained_variance": _explained_variance(pooled),
        "critic/grad_norm": float(np.mean([float(m["grad_norm"]) for m in kept])),
        "critic/clipfrac": pooled["clipfrac"] / n,
    }


class Critic(EngineDriver):
    """Host driver of the critic: values for GAE, and ``ppo_epochs · ceil(n / mini_batch)``
    value-loss updates per pipeline step (``update.UpdateEngine``).

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
        shardings = train_state_shardings(state, self.mesh)
        self.engine = UpdateEngine(state, value_update_loss(self.graphdef, config), config,
                                   self.mesh, shardings,
                                   config.packing.batch_keys(CRITIC_BATCH_KEYS))
        self.compute_values = make_compute_values(
            self.graphdef, self.mesh, shardings.params, config.packing.row_prefixes,
            config.packing.batch_keys(VALUE_BATCH_KEYS))

    # ---- values -----------------------------------------------------------------------------
    def sample_values(self, samples: Sequence[Sample]) -> list[np.ndarray]:
        """Per-sample ``[len(sample)]`` fp32 ``V_k`` (the value of the state token ``k`` was
        generated in); 0 on each sample's first token and beyond ``sequence_length``."""
        return per_sample_outputs(samples, self.config.packing, self.mesh, self.compute_values,
                                  self.state.params,
                                  self.config.packing.batch_keys(VALUE_BATCH_KEYS))

    # ---- one pipeline step ------------------------------------------------------------------
    def step(
        self, samples: Sequence[Sample], learning_rate: float | Sequence[float] | None = None
    ) -> dict[str, float]:
        """Value-loss updates on ``samples`` (which carry ``returns`` and old ``values``).

        ``learning_rate``: one LR for every update, one per update, or None for
        ``config.learning_rate``. Returns host-side ``critic/*`` metrics.
        """
        cfg = self.config
        if not samples:
            raise ValueError("Critic.step got no samples")
        if any(s.returns is None or s.values is None for s in samples):
            raise ValueError("Critic.step needs samples with returns and values (GAE samples)")
        lr = np.asarray(cfg.learning_rate if learning_rate is None else learning_rate,
                        np.float32).reshape(-1)
        if lr.size == 1:
            lr = np.full(updates_per_step(len(samples), cfg.mini_batch_size, cfg.ppo_epochs),
                         lr[0], np.float32)
        lrs = check_learning_rates(lr, len(samples), cfg, "critic")
        per_update, _ = self.engine.run(samples, lrs)
        out = _aggregate(per_update)
        out["critic/lr"] = float(np.mean(lrs))
        out["critic/nonfinite_updates"] = float(sum(int(m["nonfinite"]) for m in per_update))
        return out


def gae_rollout_metrics(samples: Sequence[Sample]) -> dict[str, float]:
    """Over the loss tokens of GAE samples (which carry old ``values`` and ``returns``):
    ``critic/rollout_values_mean``, ``critic/rollout_returns_mean``,
    ``critic/rollout_explained_variance`` (of the old values for the GAE returns) and
    ``critic/gae_advantages_mean``; {} when there is no loss token."""
    on = [s.loss_mask > 0 for s in samples]
    if not samples or not any(m.any() for m in on):
        return {}
    v_all, r_all, a_all = (np.concatenate([getattr(s, f)[m] for s, m in zip(samples, on,
                                                                             strict=True)])
                           for f in ("values", "returns", "advantages"))
    var_r = float(np.var(r_all))
    return {
        "critic/rollout_values_mean": float(v_all.mean()),
        "critic/rollout_returns_mean": float(r_all.mean()),
        "critic/rollout_explained_variance": (
            1.0 - float(np.var(r_all - v_all)) / var_r if var_r > 0 else float("nan")
        ),
        "critic/gae_advantages_mean": float(a_all.mean()),
    }
