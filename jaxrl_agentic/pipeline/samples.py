"""Samples with per-token advantages (a ``"token"``-level estimator such as GAE)."""

from __future__ import annotations

from jaxrl_agentic.algos.estimators import DEFAULT_SETTINGS, AdvantageSettings, token_advantages
from jaxrl_agentic.data.samples import build_samples, trajectory_sample
from jaxrl_agentic.training.critic import Critic, gae_rollout_metrics


def token_estimator_samples(trajs, *, adv_estimator: str,
                            settings: AdvantageSettings = DEFAULT_SETTINGS,
                            critic: Critic | None = None):
    """Trajectory samples with per-token advantages (a ``"token"``-level estimator of
    ``algos/estimators.py``), and counts.

    GAE: the critic's ``V`` on each trajectory sample (before any update of this step) →
    ``token_advantages`` → ``build_samples`` with the returns ``R = A + V`` and the old
    values for the value loss's clipping, plus ``gae_rollout_metrics``. Trajectories without
    turns give no sample.
    """
    played = [t for t in trajs if t.turns]
    if not played:
        return [], {"batch/sequences_before_merge": 0.0, "batch/sequences_after_merge": 0.0,
                    "batch/empty_trajectories": float(len(trajs))}
    values = None
    if critic is not None:
        values = critic.sample_values([trajectory_sample(t, 0.0) for t in played])
    advantages, returns = token_advantages(played, adv_estimator=adv_estimator,
                                           settings=settings, values=values)
    samples, stats = build_samples(played, advantages, sample_mode="trajectory",
                                   token_level=True, returns=returns, values=values)
    stats["batch/empty_trajectories"] = float(len(trajs) - len(played))
    if critic is not None:
        stats.update(gae_rollout_metrics(samples))
    return samples, stats
