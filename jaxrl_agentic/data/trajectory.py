"""What a rollout produces: one append-only token stream per episode, plus a record per turn.

Turn t's context is exactly `tokens[:turn.context_len]`; what the model generated on that
turn is `tokens[turn.context_len : turn.context_len + len(turn.generated)]`. Everything else
in the stream (chat template, observations, a post-hoc EOS the code appended) was not
generated and always carries loss mask 0.
"""

from __future__ import annotations

import dataclasses

import numpy as np

# Ids of an episode's later segments: base + first segment's id × MAX + k, above the
# pipeline's trajectory ids and within the sampler's int32 seed ids.
SEGMENT_ID_BASE = 1 << 30
MAX_SEGMENTS_PER_EPISODE = 64


@dataclasses.dataclass
class Turn:
    context_len: int  # stream length when generation started (the prompt of this turn)
    generated: list[int]  # token ids the model produced
    logprobs: np.ndarray  # sampler logprob of each generated token
    stop_reason: str  # "eos" | "stop" | "length"
    eos_appended: bool  # the code appended an EOS after `generated` (loss mask 0)
    reward: float
    action: int  # parsed action id, or -1 for an invalid reply
    action_is_valid: bool
    action_is_effective: bool
    success: bool
    done: bool  # the environment terminated on this turn
    state_hash: bytes  # hash of the env state the action was chosen in (GiGPO anchor)
    reply: str = ""
    # The policy version (learner steps finished) that sampled each generated token
    # [len(generated)] int32; None until recorded (a rollout with one policy throughout is
    # stamped with its version by the pipeline: `stamp_versions`).
    versions: np.ndarray | None = None


@dataclasses.dataclass
class Trajectory:
    traj_id: int
    group_id: int  # members of a group start from the same seed (same map)
    tag: str  # the env tag of this group
    seed: int
    tokens: list[int]
    turns: list[Turn]
    terminated: bool = False  # the environment ended the episode
    truncated: bool = False  # max_turns, max_steps_in_episode or max_input_length ended it
    truncated_by_length: bool = False  # the next prompt would have exceeded max_input_length
    metrics: dict = dataclasses.field(default_factory=dict)
    member: int = 0  # index within the group (selects the dynamics noise for replays)
    # 0 for an episode's first (or only) sample. An episode whose history was rewritten (an
    # outside agent's summary: `serving/`; a history policy: `rollout/segments.py`)
    # continues in segments 1, 2, …: trajectories of
    # their own, with the episode's (tag, group_id, member), its reward on the last
    # segment's last turn, and its group statistics (`episode_segments`, `joined_episode`).
    segment: int = 0
    # The player this trajectory plays in a multi-seat game (`rollout/seats.py`: each
    # policy seat is a trajectory of its own); a baseline per seat (`_norm_keys`). 0 else.
    seat: int = 0

    @property
    def score(self) -> float:
        """Episode score used by outcome estimators: the sum of turn rewards."""
        return float(sum(t.reward for t in self.turns))

    def loss_mask(self) -> np.ndarray:
        """1 exactly on the tokens the model generated, over the whole stream."""
        mask = np.zeros(len(self.tokens), np.float32)
        for turn in self.turns:
            mask[turn.context_len : turn.context_len + len(turn.generated)] = 1.0
        return mask

    def stream_logprobs(self) -> np.ndarray:
        """Sampler logprobs aligned with `tokens` (0 where the model did not generate)."""
        out = np.zeros(len(self.tokens), np.float32)
        for turn in self.turns:
            out[turn.context_len : turn.context_len + len(turn.generated)] = turn.logprobs
        return out

    def token_versions(self) -> np.ndarray:
        """The policy version of every generated token, turn after turn ([n] int32; a turn
        not stamped yet counts as -1)."""
        parts = [np.full(len(t.generated), -1, np.int32) if t.versions is None
                 else np.asarray(t.versions, np.int32) for t in self.turns]
        return np.concatenate(parts) if parts else np.zeros(0, np.int32)


def episode_segments(trajs) -> list[list[int]]:
    """Indices of `trajs` grouped by episode, each episode's segments in `segment` order,
    episodes in the order their first trajectory appears. Segments of one episode share
    (tag, group_id, member) and differ in `segment`; a trajectory of segment 0 whose key no
    later segment shares is an episode of its own (trajectories built without a `member`
    may share one)."""
    # (getattr: estimators are also given duck-typed trajectories without these fields)
    keys = [(t.tag, t.group_id, getattr(t, "member", 0)) for t in trajs]
    split = {k for k, t in zip(keys, trajs, strict=True) if getattr(t, "segment", 0) > 0}
    out, at = [], {}
    for i, key in enumerate(keys):
        if key not in split:
            out.append([i])
        elif key in at:
            out[at[key]].append(i)
        else:
            at[key] = len(out)
            out.append([i])
    for indices in out:
        if len(indices) == 1:
            continue
        indices.sort(key=lambda i: trajs[i].segment)
        segments = [trajs[i].segment for i in indices]
        if segments != list(range(len(segments))):
            t = trajs[indices[0]]
            raise ValueError(f"episode (tag {t.tag!r}, group {t.group_id}, member "
                             f"{t.member}) has segments {segments}, not 0, 1, …: two "
                             "episodes share a member, or a segment is missing")
    return out


def segment_traj_id(first_id: int, segment: int) -> int:
    """The trajectory id of segment `segment` of the episode whose first segment has id
    `first_id` (unique: ids below ``SEGMENT_ID_BASE`` are first segments)."""
    if not 0 <= segment < MAX_SEGMENTS_PER_EPISODE:
        raise ValueError(f"segment {segment} is not in [0, {MAX_SEGMENTS_PER_EPISODE})")
    return first_id if segment == 0 else (
        SEGMENT_ID_BASE + first_id * MAX_SEGMENTS_PER_EPISODE + segment)


def joined_episode(segments) -> Trajectory:
    """The whole episode of its segments (in order) as one trajectory, for what is computed
    per episode (advantages, episode metrics): their turns in order, the last segment's end
    flags, the segments' numeric metrics summed. Its `tokens` are the first segment's; the
    turns' `context_len` are those of their own segments' streams, so it is no stream to
    train on."""
    if len(segments) == 1:
        return segments[0]
    first, last = segments[0], segments[-1]
    metrics: dict = {}
    for seg in segments:
        for key, value in seg.metrics.items():
            metrics[key] = metrics.get(key, 0.0) + value
    return dataclasses.replace(
        first, turns=[u for seg in segments for u in seg.turns], metrics=metrics,
        terminated=last.terminated, truncated=last.truncated,
        truncated_by_length=any(seg.truncated_by_length for seg in segments), segment=0)


def version_range(turns) -> tuple[int, int]:
    """(oldest, newest) policy version among the tokens of `turns`; (-1, -1) when none of
    them has a recorded version."""
    seen = [np.asarray(t.versions) for t in turns if t.versions is not None and len(t.versions)]
    if not seen:
        return -1, -1
    return int(min(v.min() for v in seen)), int(max(v.max() for v in seen))


def stamp_versions(trajs, version: int) -> None:
    """Records `version` on every generated token that has none: a rollout played with one
    policy throughout (lockstep, or any rollout without in-flight updates)."""
    for traj in trajs:
        for turn in traj.turns:
            if turn.versions is None:
                turn.versions = np.full(len(turn.generated), version, np.int32)
