"""Tree packing: a group's shared prompt placed once in a row, its members' continuations after it.

GRPO samples a group of episodes from one start, so the members of a group begin with the
same prompt. Flat packing (:func:`~jaxrl_agentic.data.packing.pack_samples`) writes every
member whole; tree packing writes the shared part once and each member's continuation after
it::

    row   [ prefix (P tokens) | member 1 (L₁ − P)   | member 2 (L₂ − P)   | other samples ]
    seg     p ............ p    p+1 ........ p+1      p+2 ........ p+2      ...
    pre     0 ............ 0    p   ........ p        p   ........ p        0 ...
    pos     0 .......... P−1    P   ...... L₁−1       P   ...... L₂−1       0 ...

``pre`` (``PackedBatch.prefix_ids``) tells the attention kernels
(``pallas_kernels.segment_attention``) which prefix a continuation reads: each continuation
token attends causally to its own tokens and to the whole prefix, nothing else, at the
positions it has in its own sample. Every hidden state of a member is then the flat
layout's, so logprobs, losses and gradients equal the flat layout's to rounding.

What is shared (:func:`prefix_groups`): a common start of the members' prompts, at most
``P = prompt_len − 1`` tokens of each: a GRPO group's identical first prompt (trajectory
samples), or the first prompt its step samples all begin with. Any equal tokens are equally
exact to share, so groups that begin with the same instructions are joined where that saves
tokens; the mini-batch shuffle moves each GRPO group on its own (:func:`prompt_groups`). The
prompt's last token stays in each continuation: its hidden state predicts the member's
first generated token, so kept inside the member's segment the
learner's shift-by-one (``learner.next_token_valid``, ``packing.loss_positions``) needs no
exception, and the prefix segment carries no loss token (it counts in no loss reduction).

Rows: a prefix and its continuations lie in one row (attention never crosses rows); a group
too large for a row is cut into parts, each with its own copy of the prefix. Parts, and
samples that share with nobody (placed flat), go into rows first-fit-decreasing. A part of
k members saves ``(k − 1)·P`` computed tokens (``PackedBatch.shared_saved``).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence

import numpy as np

from jaxrl_agentic.data.buckets import first_fit_decreasing, round_up_to_bucket
from jaxrl_agentic.data.types import Sample


@dataclasses.dataclass(frozen=True)
class TreePart:
    """Samples placed together: ``shared`` prefix tokens written once (0 = one sample, flat),
    then each member's tokens from ``shared`` on."""

    members: tuple[int, ...]
    shared: int

    def length(self, lengths: Sequence[int]) -> int:
        return self.shared + sum(lengths[i] - self.shared for i in self.members)

    def saved(self) -> int:
        return (len(self.members) - 1) * self.shared

    def segments(self) -> int:
        return len(self.members) + (1 if self.shared else 0)


def _common_length(a: np.ndarray, b: np.ndarray) -> int:
    n = min(len(a), len(b))
    differ = np.flatnonzero(a[:n] != b[:n])
    return int(differ[0]) if differ.size else n


def prefix_groups(samples: Sequence[Sample]) -> list[tuple[list[int], int]]:
    """``(members, shared)``: groups of samples that share their first ``shared`` tokens, all
    inside every member's prompt but its last token (``shared ≤ prompt_len − 1``).

    Built from the prompt groups (:func:`prompt_groups`, in their sorted order, so those
    with the longest common starts are neighbours): a prompt group of ``m`` shares its first
    prompt but its last token, ``s_m``; it joins the group before it when that saves more
    tokens than keeping the two apart, ``(n + m − 1)·s' > (n − 1)·s + (m − 1)·s_m`` for a
    group of ``n`` sharing ``s`` that would share ``s'`` with it, else it starts a group.
    So a batch's GRPO groups stay apart even though all share the instructions, while
    samples that share nothing else (one episode per map) share those. Identical prompts (a
    GRPO group's start, in trajectory samples) share ``prompt_len − 1``; step samples of
    one group share their first prompt. Groups of one share nothing (``shared = 0``)."""
    groups: list[tuple[list[int], int]] = []
    for unit in prompt_groups(samples):
        first = samples[unit[0]]  # the shortest prompt of the unit: a prefix of the others
        own = first.prompt_len - 1 if len(unit) > 1 else 0
        if groups:
            members, shared = groups[-1]
            prev = samples[members[-1]]
            now = min(shared if len(members) > 1 else prev.prompt_len - 1,
                      first.prompt_len - 1, _common_length(prev.tokens, first.tokens))
            apart = (len(members) - 1) * shared + (len(unit) - 1) * own
            if now > 0 and (len(members) + len(unit) - 1) * now > apart:
                groups[-1] = (members + unit, now)
                continue
        groups.append((unit, own))
    return groups


def prompt_groups(samples: Sequence[Sample]) -> list[list[int]]:
    """The samples grouped by the first prompt they start from: a GRPO group each.

    Sorted by their prompts, the samples whose prompts begin with a prompt ``A`` follow ``A``
    in one run. A group is such a run: its first prompt ``A`` (a GRPO group's identical
    first prompt in trajectory samples; in step samples its turn-0 prompt, which every later
    turn's context extends) and the samples whose prompts begin with it. A prompt that
    shares only a shorter start with ``A`` (the instructions, a system or tools block, that
    every group of a batch may begin with) starts a group of its own, and so does each
    sample with ``prompt_len ≤ 1``. These are the units the mini-batch shuffle moves
    (``minibatch.split_minibatches``): :func:`prefix_groups` may join groups that share
    their instructions where that saves tokens, which as one unit would give the same
    mini-batches in every epoch."""
    order = sorted(range(len(samples)),
                   key=lambda i: samples[i].tokens[:samples[i].prompt_len].tolist())
    groups: list[list[int]] = []
    first = None  # the first prompt of the open group
    for i in order:
        s = samples[i]
        if first is not None and len(first) <= s.prompt_len and np.array_equal(
                s.tokens[:len(first)], first):
            groups[-1].append(i)
            continue
        groups.append([i])
        first = s.tokens[:s.prompt_len] if s.prompt_len > 1 else None
    return groups


def tree_parts(samples: Sequence[Sample], lengths: Sequence[int], loads: Sequence[int],
               capacity: int, load_capacity: int) -> list[TreePart]:
    """Each prefix group cut, in order, into parts that fit a row (``capacity`` tokens,
    ``load_capacity`` loss tokens); a part of one member is placed flat."""
    parts = []
    for group, shared in prefix_groups(samples):
        current: list[int] = []
        used = load = 0
        for i in group:
            extra = lengths[i] - shared
            if current and (shared + used + extra > capacity or load + loads[i] > load_capacity):
                parts.append(_part(current, shared))
                current, used, load = [], 0, 0
            current.append(i)
            used, load = used + extra, load + loads[i]
        parts.append(_part(current, shared))
    return parts


def tree_rows(samples, lengths, loads, capacity: int, load_capacity: int):
    """(tree parts, rows of part indices): the prefix groups cut to fit a row
    (``tree_parts``), placed first-fit-decreasing under both capacities."""
    parts = tree_parts(samples, lengths, loads, capacity, load_capacity)
    rows = first_fit_decreasing([p.length(lengths) for p in parts], capacity,
                                loads=[sum(loads[i] for i in p.members) for p in parts],
                                load_capacity=load_capacity)
    return parts, rows


def _part(members: list[int], shared: int) -> TreePart:
    return TreePart(tuple(members), shared if len(members) > 1 else 0)


def assemble_tree_rows(samples: Sequence[Sample], parts: Sequence[TreePart],
                       rows: Sequence[Sequence[int]], *, num_rows: int, row_len: int,
                       pad_token_id: int, optional_fields: tuple[str, ...],
                       max_segments: int | None = None) -> dict[str, np.ndarray]:
    """The arrays of a ``PackedBatch`` (module docstring's layout); ``rows[r]`` lists the
    part indices of row ``r``, written in that order from the row's start."""
    width = max_segments or round_up_to_bucket(
        max((sum(parts[p].segments() for p in row) for row in rows), default=1))
    shape, seg_shape = (num_rows, row_len), (num_rows, width)
    out = {"tokens": np.full(shape, pad_token_id, np.int32),
           **{n: np.zeros(shape, np.int32) for n in ("positions", "segment_ids", "prefix_ids")},
           **{n: np.zeros(shape, np.float32) for n in (
               "loss_mask", "advantages", "old_logprobs", *optional_fields)},
           **{n: np.full(seg_shape, -1, np.int32) for n in (
               "seg_traj_id", "seg_turn", "seg_prompt_len", "seg_response_len", "seg_offset",
               "sample_index")}}
    floats = ("loss_mask", "advantages", "old_logprobs", *optional_fields)
    for r, row in enumerate(rows):
        start, sid = 0, 0
        for p in row:
            part = parts[p]
            parent = 0
            if part.shared:  # the prefix segment: context only, no sample of its own
                sid += 1
                source = samples[part.members[0]]
                end = start + part.shared
                out["tokens"][r, start:end] = source.tokens[:part.shared]
                out["positions"][r, start:end] = np.arange(part.shared)
                out["segment_ids"][r, start:end] = parent = sid
                out["seg_prompt_len"][r, sid - 1] = part.shared
                out["seg_response_len"][r, sid - 1] = 0
                out["seg_offset"][r, sid - 1] = 0
                start = end
            for i in part.members:
                s, sid = samples[i], sid + 1
                end = start + len(s) - part.shared
                cut = slice(part.shared, len(s))
                out["tokens"][r, start:end] = s.tokens[cut]
                out["positions"][r, start:end] = np.arange(part.shared, len(s))
                out["segment_ids"][r, start:end] = sid
                out["prefix_ids"][r, start:end] = parent
                for name in floats:
                    out[name][r, start:end] = getattr(s, name)[cut]
                for name, value in (("seg_traj_id", s.traj_id), ("seg_turn", s.turn),
                                    ("seg_prompt_len", s.prompt_len - part.shared),
                                    ("seg_response_len", s.response_len),
                                    ("seg_offset", part.shared), ("sample_index", i)):
                    out[name][r, sid - 1] = value
                start = end
    return out
