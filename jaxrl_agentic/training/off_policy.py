"""Host-side comparisons of the sampler's logprobs with the learner's: which tokens can be
compared, their mean gap, the tokens outside a top-k/top-p support, and the truncated
importance weights (TIS) that correct an off-policy sample."""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence

import numpy as np

from jaxrl_agentic.algos.importance import importance_weights, tis_metrics
from jaxrl_agentic.data import Sample, trained_loss_mask
from jaxrl_agentic.training.learner_config import LearnerConfig
from pallas_kernels import OUT_OF_SUPPORT_LOGPROB


def comparable_masks(samples: Sequence[Sample], recomputed: Sequence[np.ndarray],
                     sequence_length: int | None) -> list[np.ndarray]:
    """Per sample, the loss tokens where the sampler's and the learner's logprobs can be
    compared: within ``sequence_length`` (the learner's values are 0 beyond it) and inside
    both supports (a top-k/top-p logprob of a token outside the kept set is the
    ``OUT_OF_SUPPORT_LOGPROB`` sentinel, not a logprob). Bool ``[len(sample)]`` each."""
    floor = OUT_OF_SUPPORT_LOGPROB / 2
    return [(trained_loss_mask(s, sequence_length) > 0) & (np.asarray(r) > floor)
            & (np.asarray(s.old_logprobs) > floor)
            for s, r in zip(samples, recomputed, strict=True)]


def logprob_mismatch(samples: Sequence[Sample], recomputed: Sequence[np.ndarray],
                     sequence_length: int | None = None) -> float:
    """Mean |sampler logprob − learner logprob| over the samples' comparable loss tokens
    (:func:`comparable_masks`)."""
    masks = comparable_masks(samples, recomputed, sequence_length)
    gap = sum(float(np.abs(s.old_logprobs - r)[m].sum())
              for s, r, m in zip(samples, recomputed, masks, strict=True))
    return gap / max(sum(int(m.sum()) for m in masks), 1)


def mismatch_kl(samples: Sequence[Sample], recomputed: Sequence[np.ndarray],
                sequence_length: int | None = None) -> float:
    """Mean k3 estimate of KL(π_sampler ‖ π_learner) over the comparable loss tokens: with
    x = log π_sampler(y) − log π_learner(y) at the tokens y the sampler drew,

        k3 = e^(−x) + x − 1  ≥ 0,        E_{y∼π_sampler}[k3] = KL(π_sampler ‖ π_learner)

    (−x clamped to ±20 as ``algos/kl.py`` does). Numerics alone keep it near 0; tokens
    sampled by older policies (asynchronous or in-flight rollouts) raise it."""
    masks = comparable_masks(samples, recomputed, sequence_length)
    total = 0.0
    for s, r, m in zip(samples, recomputed, masks, strict=True):
        neg = np.clip(np.asarray(r, np.float64) - s.old_logprobs, -20.0, 20.0)[m]
        total += float((np.exp(neg) - neg - 1.0).sum())
    return total / max(sum(int(m.sum()) for m in masks), 1)


def out_of_support_tokens(samples: Sequence[Sample], recomputed: Sequence[np.ndarray],
                          sequence_length: int | None = None) -> int:
    """Trained loss tokens that one side's logprob puts outside its top-k/top-p support."""
    masks = comparable_masks(samples, recomputed, sequence_length)
    return sum(int((trained_loss_mask(s, sequence_length) > 0).sum() - m.sum())
               for s, m in zip(samples, masks, strict=True))


def mask_out_of_support(samples: Sequence[Sample],
                        recomputed: Sequence[np.ndarray] | None = None) -> list[Sample]:
    """The samples with loss mask, advantage and old logprob 0 on each loss token whose
    sampler logprob (or ``recomputed[i]``, the learner's π_old, where given) is the
    ``OUT_OF_SUPPORT_LOGPROB`` sentinel; samples without one are returned as they are.

    Such a token has no π_old. Kept as one, its ratio once the token is back in the
    support is ``exp(min(log π + 1e4, 20))`` ≈ 4.9e8 (the loss's log-ratio clamp): the
    ratio and pg metrics are blown up, the clamp leaves it no gradient, and its advantage is
    never applied. TIS already gives it weight 0 (:func:`comparable_masks`); masked, it
    also leaves the loss, its denominator and the ratio metrics. Where the step recomputes
    π_old, ``rollout/out_of_support_tokens`` counts exactly these tokens."""
    floor = OUT_OF_SUPPORT_LOGPROB / 2
    out = []
    for i, s in enumerate(samples):
        outside = np.asarray(s.old_logprobs) <= floor
        if recomputed is not None:
            outside |= np.asarray(recomputed[i]) <= floor
        outside &= s.loss_mask > 0
        if outside.any():
            s = dataclasses.replace(s, **{
                name: np.where(outside, 0.0, getattr(s, name)).astype(np.float32)
                for name in ("loss_mask", "advantages", "old_logprobs")})
        out.append(s)
    return out


def sample_importance_weights(samples: Sequence[Sample], recomputed: Sequence[np.ndarray],
                              config: LearnerConfig) -> tuple[list[np.ndarray], dict]:
    """Per-sample TIS weights of ``π_old = recomputed`` against the sampler's logprobs, at
    ``config.tis_level`` / ``tis_mode`` / ``tis_imp_ratio_cap`` (``algos/importance.py``),
    and their metrics.

    Only comparable tokens (:func:`comparable_masks`) enter the weights: a token cut by
    ``sequence_length`` or outside a support gets weight 0 (masked, its advantage with it)
    and adds nothing to its sample's sequence or geometric ratio.

    All samples go in one call as the segments of one row padded to a power of two, so the
    sequence and geometric levels see exactly each sample's loss tokens and the few eager
    programs compile for a handful of lengths, not once per sample length.
    """
    lengths = [len(s) for s in samples]
    total = sum(lengths)
    width = max(1024, 1 << (total - 1).bit_length())
    row = lambda parts, dtype: np.pad(np.concatenate(parts).astype(dtype),  # noqa: E731
                                      (0, width - total))
    ids = row([np.full(n, i + 1) for i, n in enumerate(lengths)], np.int32)
    mask = row(comparable_masks(samples, recomputed, config.packing.sequence_length),
               np.float32)
    tis = importance_weights(row(list(recomputed), np.float32),
                             row([s.old_logprobs for s in samples], np.float32),
                             mask[None], ids[None], level=config.tis_level,
                             mode=config.tis_mode, cap=config.tis_imp_ratio_cap,
                             lower_cap=config.tis_lower_cap)
    stats = tis_metrics(tis, mask[None])
    weights = np.asarray(tis.weights)[0, :total]
    return np.split(weights, np.cumsum(lengths)[:-1]), stats
