"""KL to the reference policy: per-token estimators, coefficient controllers, reward folding.

With ``x_t = log π(y_t) − log π_ref(y_t)`` for a token ``y_t`` sampled from π, the three
estimators of ``KL(π ‖ π_ref)`` (Schulman, "Approximating KL divergence") are

    k1 = x                         unbiased, high variance, can be negative
    k2 = ½ x²                      biased, low variance, ≥ 0
    k3 = exp(−x) − (−x) − 1        unbiased, low variance, ≥ 0

(k3's exponent is clamped to ±20 exactly as in ``pallas_kernels.masked_ppo_loss`` so the loss
and the reward penalty agree token for token.)

The penalty enters training in one of two places:

* in the loss (``kl_in_reward=False``): ``objective = pg + β·KL`` with the masked sum of the
  estimator — this is what ``masked_ppo_loss`` returns as ``kl``;
* in the reward (``kl_in_reward=True``): ``r'_t = r_t − β·k(x_t)`` on every generated token
  before advantages are estimated (:func:`kl_penalised_rewards`), and the loss has no KL term.

The coefficient ``β`` comes from a controller whose state is one small pytree
(:class:`KLControllerState`), updated by a pure function once per pipeline step:

* fixed:     ``β = init_kl_coef`` forever;
* adaptive (Ziegler et al. 2019, the proportional controller):
      ``e = clip(KL_observed / KL_target − 1, −0.2, 0.2)``
      ``β ← β · (1 + e · n_steps / horizon)``
  where ``n_steps`` is the number of samples the observation covers.
"""

from __future__ import annotations

import flax.struct
import jax
import jax.numpy as jnp

from pallas_kernels.ppo_loss import KL_ESTIMATORS

# Same clamp as pallas_kernels.ppo_loss.LOG_RATIO_CLAMP (kept equal so the k3 values match).
_K3_CLAMP = 20.0
# The proportional controller's error clip (Ziegler et al.; also TRL and verl).
_ADAPTIVE_ERROR_CLIP = 0.2


@flax.struct.dataclass
class KLControllerState:
    """``coef``: the current β (fp32 scalar array, so changing it never recompiles).

    ``target`` (None = fixed controller) and ``horizon`` are static configuration.
    """

    coef: jax.Array
    target: float | None = flax.struct.field(pytree_node=False, default=None)
    horizon: float = flax.struct.field(pytree_node=False, default=10000.0)

    @property
    def adaptive(self) -> bool:
        return self.target is not None


def fixed_kl_controller(init_kl_coef: float) -> KLControllerState:
    """``β = init_kl_coef`` for the whole run."""
    if init_kl_coef < 0:
        raise ValueError(f"init_kl_coef must be >= 0, got {init_kl_coef}")
    return KLControllerState(coef=jnp.asarray(init_kl_coef, jnp.float32))


def adaptive_kl_controller(
    init_kl_coef: float, target_kl: float, horizon: float = 10000.0
) -> KLControllerState:
    """Proportional controller steering the observed KL towards ``target_kl`` (module doc)."""
    if not init_kl_coef > 0:
        # β = 0 is a fixed point of the multiplicative update: it would never move.
        raise ValueError(f"adaptive KL control needs init_kl_coef > 0, got {init_kl_coef}")
    if not target_kl > 0 or not horizon > 0:
        raise ValueError(f"need target_kl > 0 and horizon > 0, got {target_kl}, {horizon}")
    return KLControllerState(
        coef=jnp.asarray(init_kl_coef, jnp.float32),
        target=float(target_kl),
        horizon=float(horizon),
    )


def init_kl_controller(
    init_kl_coef: float, target_kl: float | None = None, horizon: float = 10000.0
) -> KLControllerState:
    """Fixed controller when ``target_kl`` is None, adaptive otherwise."""
    if target_kl is None:
        return fixed_kl_controller(init_kl_coef)
    return adaptive_kl_controller(init_kl_coef, target_kl, horizon)


def update_kl_controller(
    state: KLControllerState, observed_kl: jax.Array | float, n_steps: int
) -> KLControllerState:
    """One controller step. Fixed: unchanged. Adaptive:
    ``β ← β · (1 + clip(KL/target − 1, −0.2, 0.2) · n_steps / horizon)``.

    A non-finite ``observed_kl`` (a diverged batch) leaves β unchanged rather than poisoning
    every later update.
    """
    if not state.adaptive:
        return state
    kl = jnp.asarray(observed_kl, jnp.float32)
    error = jnp.clip(kl / state.target - 1.0, -_ADAPTIVE_ERROR_CLIP, _ADAPTIVE_ERROR_CLIP)
    new_coef = state.coef * (1.0 + error * (n_steps / state.horizon))
    return state.replace(coef=jnp.where(jnp.isfinite(kl), new_coef, state.coef))


def kl_estimate(logprobs: jax.Array, ref_logprobs: jax.Array, estimator: str = "k3") -> jax.Array:
    """Per-token estimator ``k(x)`` with ``x = logprobs − ref_logprobs`` (module doc)."""
    if estimator not in KL_ESTIMATORS:
        raise ValueError(f"unknown kl_estimator {estimator!r}; expected one of {KL_ESTIMATORS}")
    x = jnp.asarray(logprobs, jnp.float32) - jnp.asarray(ref_logprobs, jnp.float32)
    if estimator == "k1":
        return x
    if estimator == "k2":
        return 0.5 * x * x
    neg = jnp.clip(-x, -_K3_CLAMP, _K3_CLAMP)
    return jnp.exp(neg) - neg - 1.0


def kl_penalised_rewards(
    rewards: jax.Array,
    logprobs: jax.Array,
    ref_logprobs: jax.Array,
    coef: jax.Array | float,
    estimator: str = "k1",
    loss_mask: jax.Array | None = None,
) -> jax.Array:
    """Per-token rewards with the KL folded in: ``r'_t = r_t − β · k(x_t) · m_t``.

    All arrays share one shape (``[T]`` or ``[B, T]``). ``loss_mask`` (``m``; default all ones)
    restricts the penalty to generated tokens: observation and prompt tokens were not
    sampled from π, so their ``x`` says nothing about the policy's divergence.
    """
    kl = kl_estimate(logprobs, ref_logprobs, estimator)
    if loss_mask is not None:
        kl = jnp.where(jnp.asarray(loss_mask) > 0, kl, 0.0)
    return jnp.asarray(rewards, jnp.float32) - jnp.asarray(coef, jnp.float32) * kl
