"""Collapse diagnostics: is the group still exploring, is the policy still moving?

Pure numpy on host data, one call per pipeline step:

    batch/group_reward_std           mean over groups of the within-group std (ddof 0) of
                                     rewards; → 0 when every group agrees (no signal left)
    batch/zero_variance_groups       fraction of groups with max − min ≤ tol (filters.py)
    batch/distinct_replies_per_group mean over groups of the number of distinct replies
                                     (token tuples); → 1 when sampling has collapsed

and :func:`most_common_replies` / :func:`most_common_replies_text` for a TensorBoard text
of what the policy keeps saying. A group of one has std 0 and one distinct reply; it is
counted like any other group.
"""

from __future__ import annotations

import collections
from collections.abc import Callable, Sequence

import numpy as np

from jaxrl_agentic.algos.filters import ZERO_VARIANCE_TOL, zero_variance_groups


def group_reward_metrics(rewards, group_ids, *, tol: float = ZERO_VARIANCE_TOL
                         ) -> dict[str, float]:
    """``batch/group_reward_std`` and ``batch/zero_variance_groups`` (module doc)."""
    rewards = np.asarray(rewards, np.float64).reshape(-1)
    if rewards.size == 0:
        return {"batch/group_reward_std": 0.0, "batch/zero_variance_groups": 0.0}
    groups, inverse = np.unique(np.asarray(group_ids).reshape(-1), return_inverse=True)
    count = np.bincount(inverse, minlength=groups.size)
    mean = np.bincount(inverse, rewards, minlength=groups.size) / count
    var = np.bincount(inverse, (rewards - mean[inverse]) ** 2, minlength=groups.size) / count
    _, degenerate = zero_variance_groups(rewards, group_ids, tol=tol)
    return {"batch/group_reward_std": float(np.sqrt(var).mean()),
            "batch/zero_variance_groups": float(degenerate.mean())}


def distinct_replies_per_group(replies: Sequence[Sequence[int]], group_ids) -> dict[str, float]:
    """``batch/distinct_replies_per_group``: mean number of distinct token tuples per group."""
    distinct: dict = collections.defaultdict(set)
    for reply, group in zip(replies, np.asarray(group_ids).reshape(-1).tolist(), strict=True):
        distinct[group].add(tuple(int(t) for t in reply))
    value = float(np.mean([len(s) for s in distinct.values()])) if distinct else 0.0
    return {"batch/distinct_replies_per_group": value}


def most_common_replies(replies: Sequence[Sequence[int]], top_n: int = 5
                        ) -> list[tuple[tuple[int, ...], int]]:
    """The ``top_n`` most frequent replies with their counts (ties: first seen first)."""
    counts = collections.Counter(tuple(int(t) for t in r) for r in replies)
    return counts.most_common(top_n)


def most_common_replies_text(replies: Sequence[Sequence[int]], top_n: int = 5,
                             decode: Callable[[Sequence[int]], str] | None = None) -> str:
    """A markdown table (TensorBoard text) of :func:`most_common_replies`, decoded if a
    ``decode(token_ids) -> str`` is given (e.g. ``tokenizer.decode``)."""
    total = max(len(replies), 1)
    lines = ["| count | share | reply |", "|---:|---:|---|"]
    for reply, count in most_common_replies(replies, top_n):
        text = decode(list(reply)) if decode is not None else " ".join(map(str, reply))
        text = text.replace("|", "\\|").replace("\n", "⏎")
        lines.append(f"| {count} | {count / total:.0%} | {text} |")
    return "\n".join(lines)

