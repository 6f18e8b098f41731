"""The Qwen2.5-0.5B recipes' rows (token efficiency ≥ 0.8 at 4 episodes × 3 turns × 32
tokens). In bf16 on CPU each sample starts at a multiple of 128 in its row, so the
sampler's attention blocks are the learner's (`run_config.sample_align`); with row lengths
only down to 1,024, four ~400-token samples took one 2,048-token row (0.79). The recipes'
rows go down to 432, where four rows of 432 hold them (0.93, as measured by
`scripts/analysis/real_shape_step.py`: 1,608 real tokens of 1,728 computed)."""

import os

import numpy as np
import pytest

from jaxrl_agentic.data import Sample
from jaxrl_agentic.run_config import packing_config
from jaxrl_agentic.train import parse_config

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def _sample(n: int) -> Sample:
    mask = np.r_[np.zeros(n - 96), np.ones(96)]
    return Sample(tokens=np.ones(n, np.int32), loss_mask=mask, old_logprobs=np.zeros(n),
                  advantages=mask, prompt_len=n - 96)


@pytest.mark.parametrize("recipe", ["qwen2_5_0_5b_frozen_lake", "qwen2_5_0_5b_tool_calculator"])
def test_four_aligned_samples_of_400_tokens_compute_at_most_1_25x_their_tokens(recipe):
    c = parse_config(["train", f"--config={os.path.join(ROOT, 'configs', recipe + '.py')}"])
    packing = packing_config(c)
    assert c.dtype == "bfloat16" and packing.sample_align == 128  # on this CPU
    samples = [_sample(n) for n in (398, 402, 403, 405)]
    batch = packing.pack(samples, rows_bucket=1)
    busy_rows = int((batch.segment_ids > 0).any(axis=1).sum())
    real = sum(len(s) for s in samples)
    assert real / (busy_rows * batch.row_len) >= 0.8, (busy_rows, batch.row_len)
    # Every sample starts at a multiple of 128 of its row.
    starts = np.flatnonzero(np.diff(batch.segment_ids, axis=1, prepend=0).ravel() > 0)
    assert np.all(starts % batch.row_len % 128 == 0)
