"""The unit of training data: one sample = one token sequence with its per-token targets.

A sample is what packing, batching and the losses consume. It is produced either per
episode (trajectory mode) or per turn (step mode, optionally prefix-merged); this module
does not care which, it only checks that the per-token arrays agree with each other.

Layout of a sample of length ``L`` (``prompt_len = P``)::

    index      0 ........ P-1 | P ......................... L-1
    tokens     prompt (context)| response (generated, maybe with observation deltas)
    loss_mask  0 ........... 0 | 1 where the model generated the token, else 0
    old_logp   0 ........... 0 | sampler logprob where mask = 1, else 0
"""

from __future__ import annotations

import dataclasses

import numpy as np

_PER_TOKEN_FLOAT_FIELDS = ("old_logprobs", "advantages", "ref_logprobs", "returns", "values")


@dataclasses.dataclass
class Sample:
    """One training sequence. Per-token fields are 1-D numpy arrays of the same length ``L``.

    Attributes:
      tokens: ``[L] int32`` token ids, prompt first, then the response.
      loss_mask: ``[L] float32`` 1 where the model generated the token (trained on), else 0.
        Booleans are accepted and converted.
      old_logprobs: ``[L] float32`` sampler logprobs of the generated tokens, 0 where mask 0.
      advantages: ``[L] float32`` per-token advantages (outcome estimators broadcast a scalar
        over the sample's own mask).
      ref_logprobs: optional ``[L] float32`` reference-policy logprobs (KL penalty).
      returns, values: optional ``[L] float32`` targets and old values for a critic (GAE).
      traj_id: which trajectory (episode) the sample came from.
      turn: turn index of the first generated turn in the sample (0 in trajectory mode).
      prompt_len: number of leading context tokens; the response starts at ``prompt_len``.
      min_version, max_version: the oldest and newest policy version (learner steps
        finished) that sampled a token of the sample; -1 when not recorded.
    """

    tokens: np.ndarray
    loss_mask: np.ndarray
    old_logprobs: np.ndarray
    advantages: np.ndarray
    ref_logprobs: np.ndarray | None = None
    returns: np.ndarray | None = None
    values: np.ndarray | None = None
    traj_id: int = 0
    turn: int = 0
    prompt_len: int = 0
    min_version: int = -1
    max_version: int = -1

    def __post_init__(self) -> None:
        self.tokens = np.asarray(self.tokens, dtype=np.int32)
        self.loss_mask = np.asarray(self.loss_mask).astype(np.float32)
        for name in _PER_TOKEN_FLOAT_FIELDS:
            value = getattr(self, name)
            if value is not None:
                setattr(self, name, np.asarray(value, dtype=np.float32))
        self.traj_id, self.turn, self.prompt_len = (
            int(self.traj_id),
            int(self.turn),
            int(self.prompt_len),
        )
        self._validate()

    def _validate(self) -> None:
        if self.tokens.ndim != 1 or self.tokens.size == 0:
            raise ValueError(
                f"Sample.tokens must be a non-empty 1-D array, got shape {self.tokens.shape}"
            )
        length = self.tokens.shape[0]
        for name in ("loss_mask", *_PER_TOKEN_FLOAT_FIELDS):
            value = getattr(self, name)
            if value is not None and value.shape != (length,):
                raise ValueError(
                    f"Sample.{name} has shape {value.shape} but tokens has shape ({length},) "
                    f"(traj_id={self.traj_id}, turn={self.turn})"
                )
        if not 0 <= self.prompt_len <= length:
            raise ValueError(
                f"Sample.prompt_len={self.prompt_len} must lie in [0, len(tokens)={length}]"
            )
        if not np.all((self.loss_mask == 0) | (self.loss_mask == 1)):
            raise ValueError("Sample.loss_mask must contain only 0 and 1")
        if np.any(self.loss_mask[: self.prompt_len]):
            raise ValueError(
                f"Sample.loss_mask is 1 inside the prompt (first {self.prompt_len} tokens); "
                "prompt tokens are never trained on"
            )
        for name in _PER_TOKEN_FLOAT_FIELDS:
            value = getattr(self, name)
            if value is not None and not np.all(np.isfinite(value)):
                raise ValueError(f"Sample.{name} contains NaN or inf")

    def __len__(self) -> int:
        return int(self.tokens.shape[0])

    @property
    def response_len(self) -> int:
        """Tokens from ``prompt_len`` to the end (generated plus any observation deltas)."""
        return len(self) - self.prompt_len

    @property
    def num_loss_tokens(self) -> int:
        return int(self.loss_mask.sum())


def truncate_sample(sample: Sample, max_len: int) -> tuple[Sample, bool]:
    """Cuts ``sample`` to its first ``max_len`` tokens; returns ``(sample, was_truncated)``.

    Truncation is from the right: the tail tokens are dropped together with their masks,
    logprobs and advantages, and ``prompt_len`` becomes ``min(prompt_len, max_len)``. The
    prompt is kept intact because every kept token's logprob was computed with exactly that
    left context; cutting from the left would change the context and make the learner's
    recomputed logprobs disagree with ``old_logprobs``. A sample whose prompt alone exceeds
    ``max_len`` keeps no response and so contributes nothing to the loss.
    """
    if max_len <= 0:
        raise ValueError(f"truncate_sample max_len must be positive, got {max_len}")
    if len(sample) <= max_len:
        return sample, False
    cut = {
        name: (None if getattr(sample, name) is None else getattr(sample, name)[:max_len])
        for name in ("tokens", "loss_mask", *_PER_TOKEN_FLOAT_FIELDS)
    }
    truncated = dataclasses.replace(sample, **cut, prompt_len=min(sample.prompt_len, max_len))
    return truncated, True


def trained_loss_mask(sample: Sample, sequence_length: int | None) -> np.ndarray:
    """``sample.loss_mask`` on the tokens the learner trains on: 0 from ``sequence_length`` on.

    The learner cuts a sample to ``sequence_length`` tokens (:func:`truncate_sample`), and the
    per-token values it computes for a sample (recomputed or reference logprobs) are 0 there.
    Anything that compares those values with the sampler's (TIS weights, the logprob
    mismatch, the KL folded into the rewards) must read the tokens under this mask only.
    """
    mask = np.asarray(sample.loss_mask)
    if sequence_length is None or len(mask) <= sequence_length:
        return mask
    return np.where(np.arange(len(mask)) < sequence_length, mask, 0).astype(mask.dtype)
