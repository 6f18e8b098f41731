"""Episode metrics of a rollout: the env-side means the run logs (per tag when there are
several), tool-call totals of tool envs, outside agents' `agent/*` totals, two-player games'
win / draw / loss rates."""

from __future__ import annotations

import numpy as np

from jaxrl_agentic.data.trajectory import episode_segments, joined_episode
from jaxrl_agentic.envs.metrics import episode_metrics
from jaxrl_agentic.envs.outside_agent import agent_metrics
from jaxrl_agentic.envs.textarena_games import game_metrics
from jaxrl_agentic.envs.tools import tool_metrics


def mean_of(values) -> float:
    values = list(values)
    return float(np.mean(values)) if values else 0.0


def whole_episodes(trajs) -> list:
    """One trajectory per episode: an episode in segments (`Trajectory.segment`) joined,
    its episode metrics recomputed over all its turns and its counters summed."""
    out = []
    for indices in episode_segments(trajs):
        if len(indices) == 1:
            out.append(trajs[indices[0]])
            continue
        joined = joined_episode([trajs[i] for i in indices])
        joined.metrics.update(episode_metrics(
            [u.reward for u in joined.turns],
            [{"action_is_valid": u.action_is_valid, "action_is_effective":
              u.action_is_effective, "success": u.success} for u in joined.turns]))
        out.append(joined)
    return out


def trajectory_metrics(trajs, prefix: str) -> dict[str, float]:
    """Means over episodes of the env-side metrics (and per tag when there are several);
    tool envs add `tool/*` totals and rates (`envs.tools.tool_metrics`). An episode in
    segments counts once (`whole_episodes`)."""
    trajs = whole_episodes(trajs)
    out = {}
    tags = sorted({t.tag for t in trajs})
    for tag in [None] + (tags if len(tags) > 1 else []):
        group = [t for t in trajs if tag is None or t.tag == tag]
        p = prefix if tag is None else f"{prefix}{tag}/"
        out[f"{p}success"] = mean_of(t.metrics["success"] for t in group)
        out[f"{p}return"] = mean_of(t.metrics["return"] for t in group)
        out[f"{p}num_turns"] = mean_of(len(t.turns) for t in group)
        out[f"{p}action_is_valid"] = mean_of(t.metrics["action_is_valid"] for t in group)
        out[f"{p}action_is_effective"] = mean_of(t.metrics["action_is_effective"] for t in group)
        # Python envs: an env call that missed its deadline, or raised, ended the episode.
        out[f"{p}timeouts"] = mean_of(t.metrics.get("env_timeout", 0.0) for t in group)
        out[f"{p}errors"] = mean_of(t.metrics.get("env_error", 0.0) for t in group)
        # Tool envs: call totals, calls per episode, valid-call share ({} for other envs).
        out.update(tool_metrics([t.metrics for t in group], p))
        # Outside agents: requests, rewritten histories, failures, ... (batch totals).
        out.update(agent_metrics([t.metrics for t in group], p))
        # Two-player games: the policy seats' win / draw / loss rates, invalid moves.
        out.update(game_metrics([t.metrics for t in group], p))
    out[f"{prefix}truncated_by_length"] = mean_of(t.truncated_by_length for t in trajs)
    out.update(history_metrics(trajs, "rollout/" if prefix == "env/" else prefix))
    return out


def history_metrics(episodes, prefix: str) -> dict[str, float]:
    """What a history policy did to a batch's `episodes` (whole: `whole_episodes`), from the
    counts `rollout/segments.py` records; {} when the run's policy is "full".

    ``history_rewrites`` and ``history_tokens_dropped``: totals over the batch (a rewrite's
    tokens dropped: the whole next prompt's length minus the rewritten one's);
    ``samples_per_episode``: the mean number of segments (samples of its own) an episode
    became, 1 when no history was rewritten."""
    counted = [t for t in episodes if "history_rewrites" in t.metrics]
    if not counted:
        return {}
    return {f"{prefix}history_rewrites": float(sum(t.metrics["history_rewrites"]
                                                    for t in counted)),
            f"{prefix}history_tokens_dropped": float(sum(t.metrics["history_tokens_dropped"]
                                                          for t in counted)),
            f"{prefix}samples_per_episode": mean_of(1.0 + t.metrics["history_rewrites"]
                                                    for t in counted)}


def version_lag_metrics(trajs, version: int) -> dict[str, float]:
    """How far behind the learner (at `version`, the steps it has finished) the policies
    that sampled the tokens are, over every generated token:

        lag(token) = version − version(token)

    ``off_policy/version_lag_mean`` and ``_max``, ``off_policy/stale_token_frac`` (the share
    with lag > 0), ``off_policy/versions_per_episode`` (distinct versions in one episode,
    mean: above 1 only when an update reached a live episode)."""
    per_traj = [t.token_versions() for t in trajs]
    lags = version - np.concatenate(per_traj) if per_traj else np.zeros(0)
    if not lags.size:
        return {"off_policy/version_lag_mean": 0.0, "off_policy/version_lag_max": 0.0,
                "off_policy/stale_token_frac": 0.0, "off_policy/versions_per_episode": 0.0}
    return {"off_policy/version_lag_mean": float(lags.mean()),
            "off_policy/version_lag_max": float(lags.max()),
            "off_policy/stale_token_frac": float((lags > 0).mean()),
            "off_policy/versions_per_episode": mean_of(len(np.unique(v)) for v in per_traj
                                                       if v.size)}
