"""What the rollout asks of a sampler backend, and what a generation returns.

A backend turns prompts into replies with per-token logprobs under the policy it was given
(`set_params`). Multi-turn rollouts use it through sessions: a session holds a batch of
token streams that grow turn by turn (`extend`: the new user message; `generate`: the reply,
appended to the stream), so a backend with a KV cache prefills only what is new each turn
(prefix reuse). `sampling.jax_sampler.Sampler` is the in-process JAX backend; the format
warm-up's `ScriptedSampler` stands in for one in the turn loop. Modeled on Tunix's
`rl/rollout/base_rollout.py` (`generate`, per-token logprobs, `update_params`).

A returned logprob is that of the sampled token under the distribution the learner
recomputes (the contract "sampler and learner agree", docs/architecture.md), and a reply's
noise depends on `seed` and its row's seed id (`row_seeds`), not on the batch it shared.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from typing import Protocol, runtime_checkable

import numpy as np


@dataclasses.dataclass
class GenerationResult:
    """Per requested row, in request order: the generated ids, their logprobs and why the
    reply stopped ("eos" | "stop" | "length")."""

    tokens: list[list[int]]
    logprobs: list[np.ndarray]
    stop_reasons: list[str]


@runtime_checkable
class SamplerSession(Protocol):
    """A batch of token streams (rows) that grow turn by turn."""

    def extend(self, rows: Sequence[int], new_ids: Sequence[Sequence[int]]) -> None:
        """Appends tokens to the rows' streams (prefilled by the next `generate`)."""

    def generate(self, rows: Sequence[int], *, max_new_tokens: int, temperature: float = 1.0,
                 top_p: float = 1.0, top_k: int = 0, greedy: bool = False, seed: int = 0,
                 stop_token_ids: Sequence[int] | None = None, params=None,
                 row_seeds: Sequence[int] | None = None) -> GenerationResult:
        """Continues each of `rows` from the end of its stream and appends the reply to it;
        row r draws its noise from (`seed`, `row_seeds[r]`, default r)."""

    def reset_row(self, row: int) -> None:
        """Empties a row for a new stream."""

    def length(self, row: int) -> int:
        """Tokens in a row's stream."""


@runtime_checkable
class SamplerBackend(Protocol):
    """Generates with a policy's params; see the module docstring."""

    max_total_len: int  # the longest stream a session row can hold (prompt + replies)

    def new_session(self, num_rows: int, reserve: int = 0) -> SamplerSession:
        """A session of `num_rows` empty streams (`reserve`: cache slots to hold at once)."""

    def generate(self, prompts: Sequence[Sequence[int]], *, max_new_tokens: int,
                 temperature: float = 1.0, top_p: float = 1.0, top_k: int = 0,
                 greedy: bool = False, seed: int = 0, num_return_sequences: int = 1,
                 stop_token_ids: Sequence[int] | None = None, params=None) -> GenerationResult:
        """Single-turn generation: each prompt's replies (× `num_return_sequences`, grouped
        per prompt)."""

    def set_params(self, params) -> None:
        """Uses `params` from now on (the learner's new policy; `params=` of a call
        overrides it for that call)."""
