"""Sample validation and right truncation, checked against hand-written examples."""

import numpy as np
import pytest

from jaxrl_agentic.data.types import Sample, truncate_sample


def _sample(**overrides):
    fields = dict(
        tokens=[11, 12, 13, 14, 15, 16],
        loss_mask=[0, 0, 1, 1, 0, 1],
        old_logprobs=[0, 0, -0.5, -1.0, 0, -2.0],
        advantages=[0, 0, 1.5, 1.5, 0, 1.5],
        traj_id=7,
        turn=2,
        prompt_len=2,
    )
    fields.update(overrides)
    return Sample(**fields)


def test_converts_dtypes_and_reports_lengths():
    s = _sample(loss_mask=np.array([0, 0, 1, 1, 0, 1], dtype=bool))
    assert s.tokens.dtype == np.int32 and s.loss_mask.dtype == np.float32
    assert s.old_logprobs.dtype == np.float32 and s.advantages.dtype == np.float32
    assert (len(s), s.response_len, s.num_loss_tokens) == (6, 4, 3)
    assert s.ref_logprobs is None


@pytest.mark.parametrize(
    "overrides, message",
    [
        (dict(advantages=[0.0] * 5), "Sample.advantages has shape (5,)"),
        (dict(ref_logprobs=[0.0] * 7), "Sample.ref_logprobs has shape (7,)"),
        (dict(prompt_len=7), "prompt_len=7"),
        (dict(prompt_len=3), "loss_mask is 1 inside the prompt"),
        (dict(loss_mask=[0, 0, 2, 1, 0, 1]), "only 0 and 1"),
        (dict(advantages=[0, 0, np.nan, 0, 0, 0]), "advantages contains NaN"),
        (dict(tokens=[], loss_mask=[], old_logprobs=[], advantages=[], prompt_len=0), "non-empty"),
    ],
)
def test_rejects_inconsistent_samples_with_one_line_message(overrides, message):
    with pytest.raises(ValueError) as info:
        _sample(**overrides)
    text = str(info.value)
    assert message in text and "\n" not in text


def test_truncate_drops_tail_tokens_and_their_masks():
    s = _sample(ref_logprobs=[0, 0, -0.4, -0.9, 0, -1.9])
    cut, was_cut = truncate_sample(s, 4)
    assert was_cut
    np.testing.assert_array_equal(cut.tokens, [11, 12, 13, 14])
    np.testing.assert_array_equal(cut.loss_mask, [0, 0, 1, 1])
    np.testing.assert_array_equal(cut.old_logprobs, np.float32([0, 0, -0.5, -1.0]))
    np.testing.assert_array_equal(cut.ref_logprobs, np.float32([0, 0, -0.4, -0.9]))
    assert (cut.prompt_len, cut.response_len, cut.traj_id, cut.turn) == (2, 2, 7, 2)


def test_truncate_inside_prompt_keeps_no_response():
    cut, was_cut = truncate_sample(_sample(), 1)
    assert was_cut and cut.prompt_len == 1 and cut.response_len == 0 and cut.num_loss_tokens == 0


def test_truncate_noop_when_short_enough():
    s = _sample()
    same, was_cut = truncate_sample(s, 6)
    assert same is s and not was_cut
