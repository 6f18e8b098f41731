"""Policy losses by name: the registry `policy_loss=` reads, open to any recipe.

A policy loss maps per-token logprobs to the weighted sums the learner divides once per
update (``pallas_kernels.PPOLossSums``; ``algos/losses.py`` for the reductions). With the
token ratio ``r_t = exp(logp_t − old_t)`` and ``clip(x) = clip(x, 1 − ε_lo, 1 + ε_hi)``:

    ppo    pg_t = max(−A_t·r_t, −A_t·clip(r_t))                 (dual clip: min(·, −A_t·c), A<0)
    gspo   the same with s_t = sg(s_i)·π_t/sg(π_t),  s_i = exp(mean_{u ∈ i}(logp_u − old_u))
           (GSPO-token: one ratio value per sample, each token's own gradient)
    cispo  pg_t = −sg(clip(r_t))·A_t·logp_t                     (MiniMax-M1: the weight is
           clipped, not the update, so every token keeps a gradient)

ε_lo / ε_hi are ``pg_clip`` / ``pg_clip_high`` for a loss registered with
``bounds="pg_clip"`` and ``cispo_clip_low`` / ``cispo_clip_high`` for ``bounds="cispo_clip"``.

Registering a loss (from any module a recipe imports) makes the name valid everywhere a
``policy_loss`` is read:

    def my_loss(logprobs, old_logprobs, advantages, loss_weights, ref_logprobs, *,
                clip_low, clip_high, dual_clip, kl_estimator, segment_ids, impl):
        return pallas_kernels.masked_ppo_loss(...)   # or any PPOLossSums of your own

    register_policy_loss("my_loss", my_loss)

All arrays are 1-D ``[N]`` over the loss positions; ``segment_ids`` say which sample each
token belongs to (each sample one contiguous run; 0 = padding); ``impl`` is the PPO-loss
kernel implementation to use ("reference", "pallas" or "auto").
"""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Callable

from jaxrl_agentic.registration import same_registration
from pallas_kernels import PPOLossSums, masked_ppo_loss

BOUNDS = ("pg_clip", "cispo_clip")


@dataclasses.dataclass(frozen=True)
class PolicyLoss:
    """A registered loss: ``sums(...) -> PPOLossSums`` (module doc), which config bounds
    give its ε_lo / ε_hi, and whether a dual clip has a meaning for it."""

    sums: Callable[..., PPOLossSums]
    bounds: str = "pg_clip"
    allows_dual_clip: bool = False


_LOSSES: dict[str, PolicyLoss] = {}


def register_policy_loss(name: str, sums: Callable[..., PPOLossSums], *,
                         bounds: str = "pg_clip", allows_dual_clip: bool = False,
                         replace: bool = False) -> None:
    """Adds ``name`` (module doc for ``sums``' signature). The same registration again (a
    recipe file read twice: ``registration.same_registration``) changes nothing; another
    one of a registered name is an error unless ``replace``."""
    if not isinstance(name, str) or not name:
        raise ValueError(f"a policy loss needs a non-empty name, got {name!r}")
    if not callable(sums):
        raise TypeError(f"policy loss {name!r}: sums must be callable")
    if bounds not in BOUNDS:
        raise ValueError(f"policy loss {name!r}: bounds must be one of {BOUNDS}, got {bounds!r}")
    entry = PolicyLoss(sums, bounds, allows_dual_clip)
    if name in _LOSSES and not replace:
        if same_registration(_LOSSES[name], entry):
            return
        raise ValueError(f"policy loss {name!r} is already registered")
    _LOSSES[name] = entry


def policy_loss_names() -> tuple[str, ...]:
    return tuple(_LOSSES)


def get_policy_loss(name: str) -> PolicyLoss:
    if name not in _LOSSES:
        raise ValueError(f"unknown policy_loss {name!r}; choose one of "
                         f"{', '.join(policy_loss_names())}")
    return _LOSSES[name]


def _kernel_loss(logprobs, old_logprobs, advantages, loss_weights, ref_logprobs, *,
                 clip_low, clip_high, dual_clip, kl_estimator, segment_ids, impl,
                 surrogate, sequence_ratio):
    return masked_ppo_loss(logprobs, old_logprobs, advantages, loss_weights, ref_logprobs,
                           clip_low=clip_low, clip_high=clip_high, dual_clip=dual_clip,
                           kl_estimator=kl_estimator, surrogate=surrogate,
                           sequence_ratio=sequence_ratio,
                           segment_ids=segment_ids if sequence_ratio else None, impl=impl)


register_policy_loss("ppo", functools.partial(_kernel_loss, surrogate="clip",
                                              sequence_ratio=False), allows_dual_clip=True)
register_policy_loss("gspo", functools.partial(_kernel_loss, surrogate="clip",
                                               sequence_ratio=True))
register_policy_loss("cispo", functools.partial(_kernel_loss, surrogate="weight",
                                                sequence_ratio=False), bounds="cispo_clip")
