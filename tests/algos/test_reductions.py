"""Loss reductions: micro-batch accumulation must equal the whole-mini-batch reduction.

The reference is a per-sample python loop over the unpacked samples; the packed layout, the
micro-batch split and the padding rows must not change the result.
"""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxrl_agentic.algos.reductions import (
    REDUCTIONS,
    finalize_loss,
    loss_denominator,
    loss_sum_and_denominator,
    loss_weights,
)
from jaxrl_agentic.data.packing import pack_samples, pad_rows
from jaxrl_agentic.data.types import Sample

NORM_LENGTH = 16.0  # Dr. GRPO's constant L for seq_mean_token_sum_norm


def brute_force(samples, reduction):
    """The reduction written per sample; ``advantages`` stands in for the per-token loss."""
    losses = [s.advantages[s.loss_mask > 0] for s in samples]
    trained = [l for l in losses if l.size]
    if reduction == "token_mean":
        return sum(float(l.sum()) for l in trained) / max(sum(l.size for l in trained), 1)
    if reduction == "seq_mean_token_sum":
        return sum(float(l.sum()) for l in trained) / max(len(trained), 1)
    if reduction == "seq_mean_token_sum_norm":
        return sum(float(l.sum()) / NORM_LENGTH for l in trained) / max(len(trained), 1)
    return sum(float(l.mean()) for l in trained) / max(len(trained), 1)


def random_samples(seed, n=23):
    rng = np.random.default_rng(seed)
    samples = []
    for i in range(n):
        length = int(rng.integers(2, 20))
        prompt = int(rng.integers(1, length))
        mask = np.zeros(length)
        if i % 5 != 0:  # every fifth sample fully masked: must not count as a sequence
            mask[prompt:] = rng.random(length - prompt) < 0.7
        samples.append(
            Sample(
                tokens=rng.integers(0, 100, length),
                loss_mask=mask,
                old_logprobs=np.zeros(length),
                advantages=rng.normal(size=length) * 3 + 1,
                traj_id=i,
                prompt_len=prompt,
            )
        )
    return samples


_jitted = {
    r: jax.jit(lambda l, m, s, r=r: loss_sum_and_denominator(
        l, m, s, r, loss_norm_length=NORM_LENGTH)) for r in REDUCTIONS
}


@pytest.mark.parametrize("reduction", REDUCTIONS)
@pytest.mark.parametrize("n_micro", [1, 2, 7])
@pytest.mark.parametrize("row_tokens", [24, 64])
def test_accumulated_micro_batches_equal_brute_force(reduction, n_micro, row_tokens):
    samples = random_samples(seed=row_tokens)
    packed = pack_samples(samples, micro_batch_max_tokens=row_tokens, sequence_length=20)
    batch = pad_rows(packed, packed.num_micro_batches + 3)  # all-padding rows must add nothing
    total, denom = 0.0, 0.0
    for rows in np.array_split(np.arange(batch.num_micro_batches), n_micro):
        s, d = _jitted[reduction](
            batch.advantages[rows], batch.loss_mask[rows], batch.segment_ids[rows]
        )
        total, denom = total + s, denom + d
    expected = brute_force(samples, reduction)
    np.testing.assert_allclose(float(finalize_loss(total, denom)), expected, rtol=1e-5)
    n_trained = sum(s.num_loss_tokens > 0 for s in samples)
    n_tokens = sum(s.num_loss_tokens for s in samples)
    assert float(denom) == (n_tokens if reduction == "token_mean" else n_trained)


def test_hand_example_one_row():
    # seg 1: mask 1,1 loss 1,3 | seg 2: mask 0,1,1,1 loss 9,2,4,6 | seg 3 all masked | padding
    loss = jnp.array([1.0, 3.0, 9.0, 2.0, 4.0, 6.0, 5.0, 7.0, 0.0])
    mask = jnp.array([1, 1, 0, 1, 1, 1, 0, 0, 0])
    seg = jnp.array([1, 1, 2, 2, 2, 2, 3, 3, 0])
    # Dr. GRPO with L = 4: (4/4 + 12/4) / 2 segments.
    expected = {"token_mean": 16 / 5, "seq_mean_token_sum": 16 / 2, "seq_mean_token_mean": 3.0,
                "seq_mean_token_sum_norm": 2.0}
    for reduction, value in expected.items():
        s, d = loss_sum_and_denominator(loss, mask, seg, reduction, loss_norm_length=4)
        assert float(finalize_loss(s, d)) == pytest.approx(value)
    np.testing.assert_allclose(
        loss_weights(mask, seg, "seq_mean_token_mean"), [0.5, 0.5, 0, 1 / 3, 1 / 3, 1 / 3, 0, 0, 0]
    )


def test_same_segment_id_in_different_rows_is_a_different_segment():
    mask = jnp.array([[1, 1, 1, 0], [1, 0, 0, 0]])
    seg = jnp.array([[1, 1, 1, 0], [1, 0, 0, 0]])
    np.testing.assert_allclose(
        loss_weights(mask, seg, "seq_mean_token_mean"), [[1 / 3] * 3 + [0], [1, 0, 0, 0]]
    )
    assert float(loss_denominator(mask, seg, "seq_mean_token_sum")) == 2


def test_one_dimensional_rows_and_padding_mask_ignored():
    # a stray mask bit on padding (segment 0) must not count
    mask = jnp.array([1, 1, 0, 1])
    seg = jnp.array([1, 1, 2, 0])
    for reduction in REDUCTIONS:
        w1 = loss_weights(mask, seg, reduction, loss_norm_length=2)
        w2 = loss_weights(mask[None], seg[None], reduction, loss_norm_length=2)
        assert w1.shape == (4,) and w2.shape == (1, 4)
        np.testing.assert_array_equal(w1, w2[0])
        assert float(w1[3]) == 0
        assert float(loss_denominator(mask, seg, reduction)) == (
            2 if reduction == "token_mean" else 1
        )


def test_all_masked_batch_gives_zero_loss_not_nan():
    mask, seg = jnp.zeros((2, 4)), jnp.array([[1, 1, 2, 0], [0, 0, 0, 0]])
    for reduction in REDUCTIONS:
        s, d = loss_sum_and_denominator(jnp.full((2, 4), jnp.inf), mask, seg, reduction,
                                        loss_norm_length=8)
        assert float(d) == 0 and float(finalize_loss(s, d)) == 0


def test_dividing_per_micro_batch_is_wrong():
    """The peer bug: averaging per-micro-batch means weights tokens by their row's size."""
    samples = random_samples(seed=5)
    batch = pack_samples(samples, micro_batch_max_tokens=24, sequence_length=20, rows_bucket=1)
    per_micro = [
        finalize_loss(
            *loss_sum_and_denominator(
                batch.advantages[r], batch.loss_mask[r], batch.segment_ids[r], "token_mean"
            )
        )
        for r in range(batch.num_micro_batches)
    ]
    buggy = float(np.mean(per_micro))
    assert abs(buggy - brute_force(samples, "token_mean")) > 1e-3


def test_unknown_reduction():
    with pytest.raises(ValueError, match="unknown loss reduction 'mean'"):
        loss_weights(jnp.ones(3), jnp.ones(3, jnp.int32), "mean")


def test_dr_grpo_weights_do_not_depend_on_reply_length():
    # Two samples of 2 and 6 loss tokens: every token weighs 1/L, so a long reply's tokens are
    # not diluted as under seq_mean_token_mean (1/2 vs 1/6), and D counts the 2 samples.
    mask = jnp.array([[1, 1, 0, 1, 1, 1, 1, 1, 1]])
    seg = jnp.array([[1, 1, 2, 2, 2, 2, 2, 2, 2]])
    w = loss_weights(mask, seg, "seq_mean_token_sum_norm", loss_norm_length=8)
    np.testing.assert_allclose(w, [[1 / 8] * 2 + [0] + [1 / 8] * 6])
    assert float(loss_denominator(mask, seg, "seq_mean_token_sum_norm")) == 2
    with pytest.raises(ValueError, match="loss_norm_length"):
        loss_weights(mask, seg, "seq_mean_token_sum_norm")
