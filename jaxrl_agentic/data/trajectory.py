"""What a rollout produces: one append-only token stream per episode, plus a record per turn.

Turn t's context is exactly `tokens[:turn.context_len]`; what the model generated on that
turn is `tokens[turn.context_len : turn.context_len + len(turn.generated)]`. Everything else
in the stream (chat template, observations, a post-hoc EOS the code appended) was not
generated and always carries loss mask 0.
"""

from __future__ import annotations

import dataclasses

import numpy as np


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
