"""Importance weights for the gap between the behaviour (sampler) policy and the learner's.

Truncated importance sampling (TIS), token level: with μ the behaviour policy whose
logprobs the sampler recorded and π_old the learner's recomputation at the start of the
step, every loss token gets the detached weight

    w_t = min(π_old(y_t) / μ(y_t), C) = min(exp(log π_old − log μ), C)

which multiplies its policy loss. As w_t ≥ 0 it is applied to the advantage: for PPO's
max(−A·r, −A·clip(r)) (and the dual clip), w·loss(A) = loss(w·A).
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np


def truncated_importance_weights(
    loss_masks: Sequence[np.ndarray],
    old_logprobs: Sequence[np.ndarray],
    behaviour_logprobs: Sequence[np.ndarray],
    cap: float,
) -> tuple[list[np.ndarray], dict[str, float]]:
    """Per-sample fp32 weights ``w_t`` (1 off the loss mask) and their metrics over loss
    tokens: ``off_policy/tis_weight_mean`` and ``off_policy/tis_capped_frac``."""
    weights, on_loss = [], []
    for mask, old, behaviour in zip(loss_masks, old_logprobs, behaviour_logprobs, strict=True):
        on = np.asarray(mask) > 0
        w = np.where(on, np.minimum(np.exp(old - behaviour), cap), 1.0).astype(np.float32)
        weights.append(w)
        on_loss.append(w[on])
    w = np.concatenate(on_loss) if on_loss else np.zeros(0, np.float32)
    return weights, {"off_policy/tis_weight_mean": float(w.mean()) if w.size else 1.0,
                     "off_policy/tis_capped_frac": float((w >= cap).mean()) if w.size else 0.0}
