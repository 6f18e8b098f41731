"""Debugging aid: dump the packed arrays of a pipeline step to `batch_<step>.npz`.

Per-segment arrays (`seg_traj_id`, `seg_turn`, `seg_prompt_len`, `seg_response_len`, shape
`[n_micro, max_segments]`) are indexed by `segment_id - 1` and hold -1 where unused, so
`seg_turn[r, segment_ids[r, t] - 1]` is the turn of the sample token t of row r belongs to.
"""

from __future__ import annotations

import os
from collections.abc import Sequence

import numpy as np

from jaxrl_agentic.data.packing import PackedBatch

DUMP_FIELDS = ("tokens", "positions", "segment_ids", "loss_mask", "advantages", "old_logprobs",
               "seg_traj_id", "seg_turn", "seg_prompt_len", "seg_response_len")


def dump_batch(dump_dir: str, step: int, batches: PackedBatch | Sequence[PackedBatch]) -> str:
    """Writes the micro-batches of a step (concatenated along rows); returns the path."""
    if isinstance(batches, PackedBatch):
        batches = [batches]
    os.makedirs(dump_dir, exist_ok=True)
    width = max(b.seg_traj_id.shape[1] for b in batches)

    def rows(field):
        parts = []
        for b in batches:
            a = np.asarray(getattr(b, field))
            if field.startswith("seg_") and a.shape[1] < width:
                a = np.pad(a, ((0, 0), (0, width - a.shape[1])), constant_values=-1)
            parts.append(a)
        return np.concatenate(parts, axis=0)

    arrays = {f: rows(f) for f in DUMP_FIELDS}
    path = os.path.join(dump_dir, f"batch_{step}.npz")
    tmp = path + ".tmp.npz"
    np.savez(tmp, **arrays)
    os.replace(tmp, path)  # never leave a half-written file under the final name
    return path
