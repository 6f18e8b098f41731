"""Advantage estimators by name: the registry `adv_estimator=` reads, open to any recipe.

An estimator works at one of two levels (the formulas are ``algos/advantages.py``'s):

* ``"turn"``: ``fn(trajectories, keys, settings) -> [per-turn advantages [num_turns]]``, one
  array per trajectory (or one number, the episode's, given to each of its turns);
  ``keys[i]`` is trajectory i's normalisation key (``reward_norm_by``: its group, its env
  tag, or the whole batch). Outcome estimators (grpo, rloo, reinforce) give every turn the
  episode's scalar; step estimators (gigpo, turn_grpo) one value per turn. Such advantages
  are placed on each sample's own reply tokens, in trajectory and in step mode alike.
* ``"token"``: ``fn(trajectories, settings, values) -> (per-token advantages, returns or
  None)`` over each trajectory sample's tokens (reinforce_plus_plus, gae). Per-token values
  cannot be broadcast onto separate step samples, so validation rejects them in step mode.

Any other output (another count of entries, another length, not numbers) is one
``ValueError`` that names the estimator and the trajectory.

``group_relative``: the estimator normalises within groups and needs ``group_size ≥ 2``;
``needs_critic``: the run trains a value model and passes its ``values`` (gae).

    register_advantage_estimator("my_estimator", my_fn, level="turn", group_relative=True)

makes the name valid everywhere ``adv_estimator`` is read, from any module a recipe imports.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable

import numpy as np

from jaxrl_agentic.algos.advantages import (
    gae,
    gigpo,
    grpo,
    reinforce,
    reinforce_plus_plus,
    rloo,
    turn_grpo,
)
from jaxrl_agentic.data.trajectory import episode_segments, joined_episode
from jaxrl_agentic.registration import same_registration

LEVELS = ("turn", "token")
REWARD_NORM_BY = ("group", "tag", "batch")


@dataclasses.dataclass(frozen=True)
class AdvantageSettings:
    """The run-config knobs estimators read (``config.py`` documents each)."""

    use_std: bool = True
    step_reward_gamma: float = 0.95
    gigpo_step_weight: float = 1.0
    gamma: float = 1.0
    lambd: float = 0.95


DEFAULT_SETTINGS = AdvantageSettings()


@dataclasses.dataclass(frozen=True)
class AdvantageEstimator:
    fn: Callable
    level: str = "turn"
    group_relative: bool = False
    needs_critic: bool = False


_ESTIMATORS: dict[str, AdvantageEstimator] = {}


def register_advantage_estimator(name: str, fn: Callable, *, level: str = "turn",
                                 group_relative: bool = False, needs_critic: bool = False,
                                 replace: bool = False) -> None:
    """Adds ``name`` (module doc for ``fn``'s signature at each ``level``). The same
    registration again (a recipe file read twice: ``registration.same_registration``)
    changes nothing; another one of a registered name is an error unless ``replace``."""
    if not isinstance(name, str) or not name:
        raise ValueError(f"an advantage estimator needs a non-empty name, got {name!r}")
    if not callable(fn):
        raise TypeError(f"advantage estimator {name!r}: fn must be callable")
    if level not in LEVELS:
        raise ValueError(f"advantage estimator {name!r}: level must be one of {LEVELS}")
    if needs_critic and level != "token":
        raise ValueError(f"advantage estimator {name!r}: a critic's values are per token; "
                         "needs_critic needs level='token'")
    entry = AdvantageEstimator(fn, level, group_relative, needs_critic)
    if name in _ESTIMATORS and not replace:
        if same_registration(_ESTIMATORS[name], entry):
            return
        raise ValueError(f"advantage estimator {name!r} is already registered")
    _ESTIMATORS[name] = entry


def estimator_names() -> tuple[str, ...]:
    return tuple(_ESTIMATORS)


def get_advantage_estimator(name: str) -> AdvantageEstimator:
    if name not in _ESTIMATORS:
        raise ValueError(f"adv_estimator must be one of {estimator_names()}, got {name!r}")
    return _ESTIMATORS[name]


def validate_estimator(adv_estimator: str, sample_mode: str, group_size: int) -> None:
    """One-line ValueError for combinations that would train on meaningless advantages."""
    spec = get_advantage_estimator(adv_estimator)
    if sample_mode == "step" and spec.level == "token":
        raise ValueError(
            f"adv_estimator={adv_estimator!r} gives per-token values that cannot be broadcast "
            "onto step samples; use sample_mode='trajectory' or a turn-level estimator"
        )
    if spec.group_relative and group_size < 2:
        raise ValueError(
            f"adv_estimator={adv_estimator!r} normalises within groups and needs "
            f"group_size >= 2, got {group_size}"
        )


def _norm_keys(trajectories, reward_norm_by: str) -> list:
    if reward_norm_by not in REWARD_NORM_BY:
        raise ValueError(f"reward_norm_by must be one of {REWARD_NORM_BY}, got {reward_norm_by!r}")
    # Each seat of a multi-seat game against the same seat only (role-conditioned
    # baselines: a zero-sum game's seats would otherwise cancel out in one mean).
    if reward_norm_by == "group":
        return [(t.tag, t.group_id, getattr(t, "seat", 0)) for t in trajectories]
    if reward_norm_by == "tag":
        return [(t.tag, getattr(t, "seat", 0)) for t in trajectories]
    return [0] * len(trajectories)


def turn_advantages(trajectories, *, adv_estimator: str, reward_norm_by: str = "group",
                    settings: AdvantageSettings = DEFAULT_SETTINGS) -> list[np.ndarray]:
    """Per-turn advantages [num_turns] for each trajectory (a ``"turn"``-level estimator).

    An episode without turns (its reset failed or timed out) gets an empty array and stays
    out of its group's statistics: it is no 0-score member, since nothing was played.

    An episode in segments (a rewritten history: `Trajectory.segment`) is one member of its
    group: the estimator sees the segments joined (`joined_episode`: all turns, the
    episode's reward once) and each segment gets its own turns' share of the result.
    """
    spec = get_advantage_estimator(adv_estimator)
    if spec.level != "turn":
        raise ValueError(f"turn_advantages does not handle {adv_estimator!r}; token-level "
                         "estimators use token_advantages")
    episodes = episode_segments(trajectories)
    if len(episodes) < len(trajectories):
        joined = [joined_episode([trajectories[i] for i in e]) for e in episodes]
        per_episode = turn_advantages(joined, adv_estimator=adv_estimator,
                                      reward_norm_by=reward_norm_by, settings=settings)
        out = [np.zeros(0, np.float32) for _ in trajectories]
        for indices, advantages in zip(episodes, per_episode, strict=True):
            start = 0
            for i in indices:
                out[i] = advantages[start:start + len(trajectories[i].turns)]
                start += len(trajectories[i].turns)
        return out
    played = [i for i, t in enumerate(trajectories) if t.turns]
    out = [np.zeros(0, np.float32) for _ in trajectories]
    kept = [trajectories[i] for i in played]
    if kept:
        values = _one_per_trajectory(adv_estimator, spec.fn(
            kept, _norm_keys(kept, reward_norm_by), settings), kept)
        for i, t, a in zip(played, kept, values, strict=True):
            out[i] = _checked(adv_estimator, a, (len(t.turns),), t, "per-turn advantages",
                              scalar_ok=True)
    return out


def _one_per_trajectory(name: str, values, trajectories) -> list:
    """An estimator's output as a list with one entry per trajectory, or one clear error
    naming the estimator."""
    try:
        values = list(values)
    except TypeError:
        raise ValueError(f"advantage estimator {name!r} must return one entry per trajectory "
                         f"(a list), got {type(values).__name__}") from None
    if len(values) != len(trajectories):
        raise ValueError(f"advantage estimator {name!r} returned {len(values)} entries for "
                         f"{len(trajectories)} trajectories (one per trajectory)")
    return values


def _checked(name: str, value, shape: tuple[int, ...], traj, what: str, *,
             scalar_ok: bool = False) -> np.ndarray:
    """`value` as fp32 of `shape`, or one clear error naming the estimator and the
    trajectory. ``scalar_ok``: one number stands for every turn (the episode's outcome
    advantage, as ``data.samples`` reads a scalar), and is given to each."""
    try:  # (None would become NaN)
        a = None if value is None else np.asarray(value, np.float32)
    except (TypeError, ValueError):
        a = None
    if a is not None and a.ndim == 0 and scalar_ok:
        return np.full(shape, a, np.float32)
    if a is None or a.shape != shape:
        got = f"shape {a.shape}" if a is not None else type(value).__name__
        raise ValueError(f"advantage estimator {name!r}: trajectory {traj.traj_id} needs "
                         f"{what} of shape {shape}, got {got}")
    return a


def turn_reward_tokens(traj) -> tuple[np.ndarray, np.ndarray]:
    """(token rewards, loss mask) over a trajectory's stream up to its last generated token:
    each turn's reward sits on its last generated token."""
    last = traj.turns[-1]
    end = last.context_len + len(last.generated)
    rewards = np.zeros(end, np.float32)
    for turn in traj.turns:
        if turn.generated:
            rewards[turn.context_len + len(turn.generated) - 1] += turn.reward
    return rewards, traj.loss_mask()[:end]


def token_advantages(trajectories, *, adv_estimator: str,
                     settings: AdvantageSettings = DEFAULT_SETTINGS, values=None
                     ) -> tuple[list[np.ndarray], list[np.ndarray] | None]:
    """Per-token (advantages, returns or None) aligned with each trajectory sample (a
    ``"token"``-level estimator). `values[i]` (estimators that need a critic): the critic's
    V for every token of trajectory i's sample. No trajectories (a step whose dynamic
    sampling kept none) give no advantages."""
    spec = get_advantage_estimator(adv_estimator)
    if spec.level != "token":
        raise ValueError(f"token_advantages does not handle {adv_estimator!r}")
    if spec.needs_critic and values is None and trajectories:
        raise ValueError(f"adv_estimator={adv_estimator!r} needs critic values")
    if not trajectories:
        return [], [] if spec.needs_critic else None
    split = next((t for t in trajectories if getattr(t, "segment", 0) > 0), None)
    if split is not None:  # returns would stop at a segment's end, with no reward there
        raise ValueError(f"adv_estimator={adv_estimator!r} credits tokens within one "
                         f"stream; episode (group {split.group_id}, member {split.member}) "
                         "continues in segments (a rewritten history): use a turn-level "
                         "estimator (grpo, rloo, reinforce, gigpo, turn_grpo)")
    result = spec.fn(trajectories, settings, values)
    if not (isinstance(result, tuple) and len(result) == 2):
        raise ValueError(f"advantage estimator {adv_estimator!r} must return (advantages, "
                         f"returns or None), got {type(result).__name__}")
    advantages, returns = result
    shapes = [(t.turns[-1].context_len + len(t.turns[-1].generated),) for t in trajectories]
    advantages = [_checked(adv_estimator, a, shape, t, "per-token advantages")
                  for a, shape, t in zip(_one_per_trajectory(adv_estimator, advantages,
                                                             trajectories),
                                         shapes, trajectories, strict=True)]
    if returns is not None:
        returns = [_checked(adv_estimator, r, shape, t, "per-token returns")
                   for r, shape, t in zip(_one_per_trajectory(adv_estimator, returns,
                                                              trajectories),
                                          shapes, trajectories, strict=True)]
    return advantages, returns


# ---- the built-in estimators ------------------------------------------------------------------


def _scores(trajectories) -> np.ndarray:
    return np.array([t.score for t in trajectories], np.float64)


def _turn_rewards(trajectories) -> list[np.ndarray]:
    return [np.array([u.reward for u in t.turns]) for t in trajectories]


def _per_episode(per_traj, trajectories) -> list[np.ndarray]:
    """An outcome estimator's scalar on every turn of its episode."""
    return [np.full(len(t.turns), a, np.float32) for t, a in zip(trajectories, per_traj,
                                                                  strict=True)]


def _grpo(trajs, keys, s):
    return _per_episode(grpo(_scores(trajs), keys, use_std=s.use_std), trajs)


def _rloo(trajs, keys, s):
    return _per_episode(rloo(_scores(trajs), keys), trajs)


def _reinforce(trajs, keys, s):
    return _per_episode(reinforce(_scores(trajs)), trajs)


def _gigpo(trajs, keys, s):
    # Anchor states are only comparable inside one episode group (same map).
    return gigpo(_scores(trajs), keys, _turn_rewards(trajs),
                 [[u.state_hash for u in t.turns] for t in trajs],
                 step_reward_gamma=s.step_reward_gamma, step_weight=s.gigpo_step_weight,
                 use_std=s.use_std)


def _turn_grpo(trajs, keys, s):
    return turn_grpo(keys, _turn_rewards(trajs), step_reward_gamma=s.step_reward_gamma,
                     use_std=s.use_std)


def _reinforce_plus_plus(trajs, s, values):
    rewards, masks = zip(*(turn_reward_tokens(t) for t in trajs), strict=True)
    return reinforce_plus_plus(rewards, masks, gamma=s.gamma), None


def _gae(trajs, s, values):
    rewards, masks = zip(*(turn_reward_tokens(t) for t in trajs), strict=True)
    pairs = [gae(r, v, m, gamma=s.gamma, lam=s.lambd)
             for r, v, m in zip(rewards, values, masks, strict=True)]
    return [a for a, _ in pairs], [g for _, g in pairs]


register_advantage_estimator("grpo", _grpo, group_relative=True)
register_advantage_estimator("rloo", _rloo, group_relative=True)
register_advantage_estimator("reinforce", _reinforce)
register_advantage_estimator("gigpo", _gigpo, group_relative=True)
register_advantage_estimator("turn_grpo", _turn_grpo, group_relative=True)
register_advantage_estimator("reinforce_plus_plus", _reinforce_plus_plus, level="token")
register_advantage_estimator("gae", _gae, level="token", needs_critic=True)
