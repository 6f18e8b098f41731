"""Sample filters of DAPO (Yu et al. 2025): dynamic sampling and overlong handling.

Pure numpy over per-sample arrays (host side, before packing).

**Dynamic sampling.** A group whose members all get a zero advantage costs compute and adds
no gradient; DAPO drops such groups and samples more until the batch is full. Which groups
those are is the estimator's to say, not the episode scores': under ``turn_grpo`` and
``gigpo`` (and any estimator with a batch baseline) episodes with equal scores can still
carry per-turn or batch-relative advantages. So :func:`groups_with_signal` keeps a group when
one of its members has an advantage with ``|A| > tol``, from the advantages the estimator
produced. DAPO's own rule (and verl's ``filter_groups``), equal episode scores, is
:func:`dynamic_sampling_keep` over :func:`zero_variance_groups`: the pipeline uses it for the
token-level estimators (``reinforce_plus_plus``, ``gae``), whose advantages need the whole
batch (whitening) or the critic. A group is degenerate there when ``max − min ≤ tol``. The
tolerance (absolute, default 1e-6) is far below any reward difference an environment means
and far above the float noise of summed fp32 turn rewards. A group of one is degenerate by
either rule when the estimator is group-relative.

**Overlong filtering.** A reply that was cut off (generation budget reached without EOS or a
stop string, the prompt over its limit, or the sample cut to ``sequence_length``) has a reward
that judges an unfinished answer; DAPO masks its loss (:func:`truncated_samples`,
:func:`mask_truncated`).

**Soft overlong punishment** (DAPO eq. 13), with ``L`` the reply length, ``L_max`` the budget,
``L_cache`` = ``overlong_penalty_length`` the window before it and ``P`` =
``overlong_penalty``:

    R_length(L) = 0                               L ≤ L_max − L_cache
                = (L_max − L_cache − L) / L_cache · P    L_max − L_cache < L ≤ L_max
                = −P                              L > L_max

added to the task reward. (verl computes ``min(−(L − (L_max − L_cache)) / L_cache · P, 0)``,
the same inside the budget; its replies never exceed ``L_max``.)
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

ZERO_VARIANCE_TOL = 1e-6


def zero_variance_groups(rewards, group_ids, *, tol: float = ZERO_VARIANCE_TOL):
    """``(groups, degenerate)``: the sorted distinct group ids and, per group, whether its
    rewards span at most ``tol`` (module doc)."""
    rewards = np.asarray(rewards, np.float64).reshape(-1)
    groups, inverse = np.unique(np.asarray(group_ids).reshape(-1), return_inverse=True)
    if rewards.shape != inverse.shape:
        raise ValueError(f"rewards {rewards.shape} and group_ids {inverse.shape} differ")
    high = np.full(groups.size, -np.inf)
    low = np.full(groups.size, np.inf)
    np.maximum.at(high, inverse, rewards)
    np.minimum.at(low, inverse, rewards)
    return groups, (high - low) <= tol


def dynamic_sampling_keep(rewards, group_ids, *, tol: float = ZERO_VARIANCE_TOL) -> np.ndarray:
    """Per sample: True unless its group is degenerate (all rewards within ``tol``)."""
    groups, degenerate = zero_variance_groups(rewards, group_ids, tol=tol)
    return ~degenerate[np.searchsorted(groups, np.asarray(group_ids).reshape(-1))]


def groups_with_signal(advantages: Sequence[np.ndarray], group_ids, *,
                       tol: float = ZERO_VARIANCE_TOL) -> np.ndarray:
    """Per member: True when some member of its group has an advantage with ``|A| > tol``.

    ``advantages[i]``: member i's advantages (per turn or per token, any length, empty for
    an episode that never played a turn); ``group_ids[i]``: its group.
    """
    group_ids = np.asarray(group_ids).reshape(-1)
    if len(advantages) != group_ids.size:
        raise ValueError(f"{len(advantages)} advantage arrays for {group_ids.size} group ids")
    signal = np.array([np.abs(np.asarray(a, np.float64)).max(initial=0.0) > tol
                       for a in advantages], bool)
    groups, inverse = np.unique(group_ids, return_inverse=True)
    any_signal = np.zeros(groups.size, bool)
    np.logical_or.at(any_signal, inverse, signal)
    return any_signal[inverse]


def truncated_samples(
    stop_reasons: Sequence[str] | None = None,
    *,
    prompt_lengths=None,
    max_prompt_length: int | None = None,
    total_lengths=None,
    sequence_length: int | None = None,
) -> np.ndarray:
    """Per sample: True if it was cut off, by any of the given criteria.

    ``stop_reasons``: the sampler's per-reply reason; ``"length"`` (budget reached without
    EOS or stop string) counts as truncated, ``"eos"``/``"stop"`` do not. For a step-wise or
    trajectory sample pass the reason of its last turn. ``prompt_lengths > max_prompt_length``
    and ``total_lengths > sequence_length`` (the learner cuts those samples) count too.
    """
    parts = []
    if stop_reasons is not None:
        parts.append(np.asarray([r == "length" for r in stop_reasons], bool))
    if max_prompt_length is not None:
        parts.append(np.asarray(prompt_lengths).reshape(-1) > max_prompt_length)
    if sequence_length is not None:
        parts.append(np.asarray(total_lengths).reshape(-1) > sequence_length)
    if not parts:
        raise ValueError("truncated_samples needs stop_reasons, a prompt limit or "
                         "sequence_length")
    if len({p.shape for p in parts}) != 1:
        raise ValueError(f"per-sample inputs differ in length: {[p.shape for p in parts]}")
    return np.logical_or.reduce(parts)


def mask_truncated(loss_masks: Sequence[np.ndarray], truncated) -> list[np.ndarray]:
    """Per-sample loss masks with every truncated sample's mask set to 0 (overlong filter)."""
    truncated = np.asarray(truncated, bool).reshape(-1)
    if truncated.size != len(loss_masks):
        raise ValueError(f"{len(loss_masks)} masks but {truncated.size} truncation flags")
    return [np.zeros_like(m) if t else m for m, t in zip(loss_masks, truncated, strict=True)]


def overlong_penalty(reply_lengths, max_length: int, *, overlong_penalty_length: int,
                     overlong_penalty: float = 1.0) -> np.ndarray:
    """DAPO's soft overlong punishment R_length per reply (module doc), fp32, ≤ 0."""
    if not 0 < overlong_penalty_length <= max_length:
        raise ValueError(f"need 0 < overlong_penalty_length <= max_length, got "
                         f"{overlong_penalty_length} and {max_length}")
    lengths = np.asarray(reply_lengths, np.float64)
    start = max_length - overlong_penalty_length
    ramp = (start - lengths) / overlong_penalty_length * overlong_penalty
    out = np.where(lengths <= start, 0.0, np.where(lengths <= max_length, ramp,
                                                   -overlong_penalty))
    return out.astype(np.float32)
