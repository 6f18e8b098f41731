"""Advantage estimators: small pure functions (the registry keyed by `adv_estimator`, which
applies them to trajectories, is ``algos/estimators.py``).

Notation: episode score s_i (sum of turn rewards), groups g share an initial state.

Outcome estimators (one scalar per trajectory, broadcast onto its generated tokens):
    grpo     A_i = (s_i − mean_g(s)) / (std_g(s) + ε)      (std optional; unbiased std)
    rloo     A_i = (s_i − mean_g(s)) · n/(n−1)  = s_i − mean of the other members
    reinforce A_i = s_i − mean_batch(s)                     (REINFORCE with a batch baseline)
A group of one gets A = 0 from group-relative estimators.

Per-step estimator (one scalar per turn):
    gigpo    A_{i,t} = A^E_i + ω · A^S_{i,t}
             A^E = grpo(s) within the group;  R_{i,t} = Σ_{k≥t} γ_s^{k−t} r_{i,k}
             A^S = R normalised within its anchor-state group: the turns of the group's
                   episodes whose environment state (before acting) is identical;
                   a singleton anchor group gets A^S = 0.
    turn_grpo A_{i,t} = (R_{i,t} − mean_g(R)) / (std_g(R) + ε)
             the same discounted turn returns R, normalised over *all* turns of the
             group's episodes. Each move is judged by what followed it within ~1/(1−γ_s)
             turns, not by the whole episode: with shaped per-turn rewards this is a dense,
             low-variance signal, and no turn is lost to a singleton anchor group.

Token-level estimators (trajectory mode only; per-token values cannot be broadcast onto
separate step samples, so validation rejects them in step mode):
    reinforce_plus_plus  G_t = r_t + γ G_{t+1} over generated tokens, whitened over the batch
    gae      δ_t = r_t + γ V_{t+1} − V_t,  A_t = δ_t + γλ A_{t+1},  returns = A + V
The token MDP runs over the generated tokens in order; a turn's reward sits on its last
generated token and the value after the final token is 0.
"""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Sequence

import numpy as np


def _groups(keys: Sequence) -> dict:
    members = defaultdict(list)
    for i, k in enumerate(keys):
        members[k].append(i)
    return members


def group_normalize(
    values: np.ndarray, keys: Sequence, *, use_std: bool = True, eps: float = 1e-6
) -> np.ndarray:
    """(v − mean_k) / (std_k + ε) within each key (std optional); singleton keys → 0."""
    values = np.asarray(values, np.float64)
    out = np.zeros_like(values)
    for idx in _groups(keys).values():
        if len(idx) < 2:
            continue
        v = values[idx]
        centred = v - v.mean()
        out[idx] = centred / (v.std(ddof=1) + eps) if use_std else centred
    return out.astype(np.float32)


def grpo(scores, group_keys, *, use_std: bool = True, eps: float = 1e-6) -> np.ndarray:
    return group_normalize(scores, group_keys, use_std=use_std, eps=eps)


def rloo(scores, group_keys) -> np.ndarray:
    scores = np.asarray(scores, np.float64)
    out = np.zeros_like(scores)
    for idx in _groups(group_keys).values():
        n = len(idx)
        if n < 2:
            continue
        v = scores[idx]
        out[idx] = (v - v.mean()) * n / (n - 1)
    return out.astype(np.float32)


def reinforce(scores) -> np.ndarray:
    scores = np.asarray(scores, np.float64)
    return (scores - scores.mean()).astype(np.float32)


def discounted_returns(rewards: np.ndarray, gamma: float) -> np.ndarray:
    """R_t = Σ_{k≥t} γ^{k−t} r_k."""
    out = np.zeros(len(rewards), np.float64)
    running = 0.0
    for t in range(len(rewards) - 1, -1, -1):
        running = float(rewards[t]) + gamma * running
        out[t] = running
    return out


def gigpo(
    scores,
    group_keys,
    step_rewards: Sequence[np.ndarray],
    step_hashes: Sequence[Sequence[bytes]],
    *,
    step_reward_gamma: float = 0.95,
    step_weight: float = 1.0,
    use_std: bool = True,
    eps: float = 1e-6,
) -> list[np.ndarray]:
    """Per-turn advantages [T_i] for each trajectory (see module doc)."""
    episode = grpo(scores, group_keys, use_std=use_std, eps=eps)
    returns = [discounted_returns(np.asarray(r), step_reward_gamma) for r in step_rewards]
    # Anchor groups: identical state within the same episode group.
    flat_keys, flat_returns, where = [], [], []
    for i, (hashes, ret) in enumerate(zip(step_hashes, returns, strict=True)):
        for t, h in enumerate(hashes):
            flat_keys.append((group_keys[i], h))
            flat_returns.append(ret[t])
            where.append((i, t))
    step = group_normalize(np.asarray(flat_returns), flat_keys, use_std=use_std, eps=eps)
    out = [np.full(len(r), episode[i], np.float32) for i, r in enumerate(step_rewards)]
    for (i, t), a in zip(where, step, strict=True):
        out[i][t] += step_weight * a
    return out


def turn_grpo(
    group_keys,
    step_rewards: Sequence[np.ndarray],
    *,
    step_reward_gamma: float = 0.5,
    use_std: bool = True,
    eps: float = 1e-6,
) -> list[np.ndarray]:
    """Per-turn advantages [T_i]: discounted turn returns normalised within the group."""
    returns = [discounted_returns(np.asarray(r), step_reward_gamma) for r in step_rewards]
    flat_keys = [key for key, ret in zip(group_keys, returns, strict=True) for _ in ret]
    if not flat_keys:
        return [np.zeros(0, np.float32) for _ in returns]
    flat = group_normalize(np.concatenate(returns), flat_keys, use_std=use_std, eps=eps)
    bounds = np.cumsum([len(r) for r in returns])[:-1]
    return [a.astype(np.float32) for a in np.split(flat, bounds)]


def token_discounted_returns(token_rewards: np.ndarray, mask: np.ndarray, gamma: float):
    """G over generated tokens in order (mask 1), 0 elsewhere."""
    pos = np.flatnonzero(mask)
    out = np.zeros(len(mask), np.float32)
    out[pos] = discounted_returns(np.asarray(token_rewards)[pos], gamma)
    return out


def reinforce_plus_plus(
    token_rewards: Sequence[np.ndarray], masks: Sequence[np.ndarray], *, gamma: float = 1.0,
    eps: float = 1e-6,
) -> list[np.ndarray]:
    """Discounted per-token returns, whitened over every generated token of the batch."""
    returns = [token_discounted_returns(r, m, gamma) for r, m in zip(token_rewards, masks,
                                                                     strict=True)]
    flat = np.concatenate([g[m > 0] for g, m in zip(returns, masks, strict=True)])
    mean, std = flat.mean(), flat.std()
    return [np.where(m > 0, (g - mean) / (std + eps), 0).astype(np.float32)
            for g, m in zip(returns, masks, strict=True)]


def gae(
    token_rewards: np.ndarray, values: np.ndarray, mask: np.ndarray, *, gamma: float = 1.0,
    lam: float = 0.95,
) -> tuple[np.ndarray, np.ndarray]:
    """(advantages, returns) over the generated tokens of one trajectory (0 elsewhere)."""
    pos = np.flatnonzero(mask)
    r = np.asarray(token_rewards, np.float64)[pos]
    v = np.asarray(values, np.float64)[pos]
    adv = np.zeros(len(pos))
    running = 0.0
    for k in range(len(pos) - 1, -1, -1):
        next_v = v[k + 1] if k + 1 < len(pos) else 0.0
        delta = r[k] + gamma * next_v - v[k]
        running = delta + gamma * lam * running
        adv[k] = running
    advantages = np.zeros(len(mask), np.float32)
    returns = np.zeros(len(mask), np.float32)
    advantages[pos] = adv
    returns[pos] = adv + v
    return advantages, returns


def whiten(advantages: Sequence[np.ndarray], masks: Sequence[np.ndarray], eps: float = 1e-6):
    """(a − mean) / (std + ε) over every loss token of the batch; 0 off the mask."""
    flat = np.concatenate([a[m > 0] for a, m in zip(advantages, masks, strict=True)])
    if flat.size == 0:
        return [np.zeros_like(a) for a in advantages]
    mean, std = flat.mean(), flat.std()
    return [np.where(m > 0, (a - mean) / (std + eps), 0).astype(np.float32)
            for a, m in zip(advantages, masks, strict=True)]
