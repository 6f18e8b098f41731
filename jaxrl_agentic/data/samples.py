"""Training samples from trajectories: trajectory-wise, step-wise, and prefix merge.

* `trajectory` mode (StarPO): one sample per episode, the whole stream up to the last
  generated token; loss mask 1 exactly on generated tokens; the episode's advantage on them.
* `step` mode (GiGPO-style): one sample per turn, `(context_t, generated_t)`. The response is
  the generated tokens *only*: the observation that followed lives in the next turn's
  context (peers kept it in the response and inflated sequence length ~3×).

Advantages are placed by construction on each sample's *own* generated tokens from a scalar
per (trajectory, turn): there is no copying of another sample's masked row, so the peer bug
where earlier steps of a right-aligned batch received zeros cannot happen here.

Prefix merge: consecutive step samples of one trajectory where `tokens_i` (prompt_i +
response_i) is a prefix of `prompt_{i+1}` become one sequence; every token keeps the loss
mask, old logprob and advantage it had in its own step sample, and the observation delta
gets mask 0. T samples with growing prefixes (O(T²) tokens) become one (O(T)).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import numpy as np

from jaxrl_agentic.data.trajectory import Trajectory, version_range
from jaxrl_agentic.data.types import Sample

SAMPLE_MODES = ("trajectory", "step")


def _per_turn(advantage, traj: Trajectory) -> np.ndarray:
    """``[num_turns]`` fp32 advantages: a scalar (0-d) applies to every turn; an array must
    have exactly one value per turn (a length-1 array for a longer episode is misaligned
    data, not a scalar, and raises like any other wrong length)."""
    adv = np.asarray(advantage, np.float32)
    if adv.ndim == 0:
        return np.full(len(traj.turns), adv, np.float32)
    if adv.shape != (len(traj.turns),):
        raise ValueError(f"trajectory {traj.traj_id}: {adv.shape} advantages for "
                         f"{len(traj.turns)} turns (need one per turn, or a scalar)")
    return adv


def _per_token(values, end: int, traj: Trajectory, what: str) -> np.ndarray:
    """``[end]`` fp32 per-token values of a trajectory sample; any other shape raises."""
    values = np.asarray(values, np.float32)
    if values.shape != (end,):
        raise ValueError(f"trajectory {traj.traj_id}: {values.shape} per-token {what} for a "
                         f"sample of {end} tokens")
    return values


def _versions(turns) -> dict[str, int]:
    low, high = version_range(turns)
    return {"min_version": low, "max_version": high}


def trajectory_sample(
    traj: Trajectory,
    advantage: float | np.ndarray,
    *,
    token_level: bool = False,
    returns: np.ndarray | None = None,
    values: np.ndarray | None = None,
) -> Sample | None:
    """One sample for the whole episode (None if the model never generated).

    `advantage`: a scalar, or per-turn values [num_turns], or with `token_level` one value
    per token of the sample (token estimators), masked to the generated tokens. `returns`
    and `values` (a critic's targets and old values) are per token too, also masked.
    """
    if not traj.turns:
        return None
    last = traj.turns[-1]
    end = last.context_len + len(last.generated)
    mask = traj.loss_mask()[:end]
    if token_level:
        adv = _per_token(advantage, end, traj, "advantages") * mask
    else:
        adv = np.zeros(end, np.float32)
        for turn, a in zip(traj.turns, _per_turn(advantage, traj), strict=True):
            adv[turn.context_len : turn.context_len + len(turn.generated)] = a
    return Sample(
        tokens=np.asarray(traj.tokens[:end], np.int32),
        loss_mask=mask,
        old_logprobs=traj.stream_logprobs()[:end],
        advantages=adv,
        returns=None if returns is None else _per_token(returns, end, traj, "returns") * mask,
        values=None if values is None else _per_token(values, end, traj, "values") * mask,
        traj_id=traj.traj_id,
        turn=0,
        prompt_len=traj.turns[0].context_len,
        **_versions(traj.turns),
    )


def step_samples(traj: Trajectory, advantages: Sequence[float] | np.ndarray) -> list[Sample]:
    """One gen-only sample per turn; `advantages[t]` lands on turn t's generated tokens."""
    advantages = _per_turn(advantages, traj)
    samples = []
    for t, (turn, a) in enumerate(zip(traj.turns, advantages, strict=True)):
        n_gen = len(turn.generated)
        end = turn.context_len + n_gen
        mask = np.zeros(end, np.float32)
        mask[turn.context_len :] = 1.0
        logprobs = np.zeros(end, np.float32)
        logprobs[turn.context_len :] = turn.logprobs
        samples.append(Sample(
            tokens=np.asarray(traj.tokens[:end], np.int32),
            loss_mask=mask,
            old_logprobs=logprobs,
            advantages=mask * a,
            traj_id=traj.traj_id,
            turn=t,
            prompt_len=turn.context_len,
            **_versions([turn]),
        ))
    return samples


def _extends(prev: Sample, nxt: Sample) -> bool:
    """prompt_prev + response_prev is an exact prefix of prompt_next."""
    n = len(prev.tokens)
    return (
        prev.traj_id == nxt.traj_id
        and n <= nxt.prompt_len
        and np.array_equal(prev.tokens, nxt.tokens[:n])
    )


def _merge_two(head: Sample, nxt: Sample) -> Sample:
    n = len(head.tokens)

    def splice(a, b):
        if a is None or b is None:
            return None
        out = np.array(b, copy=True)
        out[:n] = a
        out[n : nxt.prompt_len] = 0  # observation delta: not generated, no loss
        return out

    return Sample(
        tokens=np.asarray(nxt.tokens),
        loss_mask=splice(head.loss_mask, nxt.loss_mask),
        old_logprobs=splice(head.old_logprobs, nxt.old_logprobs),
        advantages=splice(head.advantages, nxt.advantages),
        ref_logprobs=splice(head.ref_logprobs, nxt.ref_logprobs),
        returns=splice(head.returns, nxt.returns),
        values=splice(head.values, nxt.values),
        traj_id=head.traj_id,
        turn=head.turn,
        prompt_len=head.prompt_len,
        # -1 = not recorded: the recorded side's bound, if any
        min_version=min((v for v in (head.min_version, nxt.min_version) if v >= 0), default=-1),
        max_version=max(head.max_version, nxt.max_version),
    )


def merge_prefix_samples(samples: Sequence[Sample]) -> list[Sample]:
    """Merges runs of samples where each extends the previous one (see module doc).

    Samples are taken in the order given (a trajectory's turns in order); a sample that does
    not extend the running sequence starts a new one.
    """
    merged: list[Sample] = []
    for sample in samples:
        if merged and _extends(merged[-1], sample):
            merged[-1] = _merge_two(merged[-1], sample)
        else:
            merged.append(sample)
    return merged


def build_samples(
    trajectories: Sequence[Trajectory],
    advantages: Callable[[Trajectory], np.ndarray] | Sequence[np.ndarray | None],
    *,
    sample_mode: str,
    merge_stepwise: bool = False,
    token_level: bool = False,
    returns: Sequence[np.ndarray | None] | None = None,
    values: Sequence[np.ndarray | None] | None = None,
) -> tuple[list[Sample], dict[str, float]]:
    """Samples for a pipeline step and their counts.

    `advantages[i]` holds per-turn advantages of trajectory i ([num_turns]; outcome
    estimators give the same value for every turn), or with `token_level` (trajectory mode
    only) per-token advantages of its trajectory sample; `returns[i]` / `values[i]` (token
    level, e.g. GAE's targets and the critic's old values) likewise per token. Entries of
    trajectories without turns are ignored.
    """
    if token_level and sample_mode != "trajectory":
        raise ValueError("token-level advantages apply to sample_mode='trajectory' only")
    if (returns is not None or values is not None) and not token_level:
        raise ValueError("per-token returns/values come with token-level advantages only")
    if sample_mode not in SAMPLE_MODES:
        raise ValueError(f"sample_mode must be one of {SAMPLE_MODES}, got {sample_mode!r}")
    if merge_stepwise and sample_mode != "step":
        raise ValueError("merge_stepwise applies to sample_mode='step' only")
    samples: list[Sample] = []
    before = 0
    for i, traj in enumerate(trajectories):
        adv = advantages(traj) if callable(advantages) else advantages[i]
        if not traj.turns:
            continue
        if sample_mode == "trajectory":
            samples.append(trajectory_sample(
                traj, adv, token_level=token_level,
                returns=None if returns is None else returns[i],
                values=None if values is None else values[i]))
            before += 1
            continue
        steps = step_samples(traj, adv)
        before += len(steps)
        samples.extend(merge_prefix_samples(steps) if merge_stepwise else steps)
    stats = {
        "batch/sequences_before_merge": float(before),
        "batch/sequences_after_merge": float(len(samples)),
        "batch/empty_trajectories": float(sum(not t.turns for t in trajectories)),
    }
    return samples, stats
