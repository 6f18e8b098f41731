"""Row groups computed on the shortest prefix that holds their real tokens
(``accumulation.on_shortest_prefix``, ``PackingConfig.row_prefixes``): which prefix runs, and that
cutting the padding off changes neither the loss, the gradients nor the logprobs."""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxrl_agentic.data import PackingConfig, Sample, pack_samples, prefix_lengths
from jaxrl_agentic.runtime.parallel import make_mesh, train_state_shardings
from jaxrl_agentic.training.accumulation import on_shortest_prefix, scan_row_groups, used_length
from jaxrl_agentic.training.learner import (
    LOGPROB_BATCH_KEYS,
    init_train_state,
    make_compute_logprobs,
    make_loss_and_grads,
)
from jaxrl_agentic.training.per_token import computed_slots
from tests.training.test_learner import BASE, BATCH_KEYS, GRAPHDEF, PARAMS, rel_err

ROW = 1024  # prefixes 512 and 1024


def test_prefix_lengths_halve_the_row_on_attention_blocks():
    assert prefix_lengths(1024, 2) == (512, 1024)  # 256 is below the 512 floor
    assert prefix_lengths(4096, 2) == (1024, 2048, 4096)
    assert prefix_lengths(4096, 3) == (512, 1024, 2048, 4096)
    assert prefix_lengths(1296, 2) == (640, 1296)  # 648 → 640, a multiple of 128
    assert prefix_lengths(512, 2) == (512,)  # the default recipe's rows: one program
    assert prefix_lengths(4096, 0) == (4096,)


def test_used_length_is_one_past_the_last_real_token_of_any_row():
    seg = np.zeros((2, 16), np.int32)
    assert int(used_length(jnp.asarray(seg))) == 0
    seg[0, :5] = 1
    seg[1, 3:9] = 2  # the second row's tokens end later, after padding at its start
    assert int(used_length(jnp.asarray(seg))) == 9


@pytest.mark.parametrize("last,expected", [(0, 0), (1, 512), (512, 512), (513, 1024),
                                           (1024, 1024)])
def test_a_group_runs_on_the_shortest_prefix_that_holds_it(last, expected):
    """The branch that runs is read off the length of the rows it was given; a group
    whose last real token sits exactly at a prefix's end runs on that prefix, one token
    more takes the next."""
    seg = np.zeros((2, ROW), np.int32)
    seg[1, :last] = 1
    micro = {"segment_ids": jnp.asarray(seg), "loss_index": jnp.full((2, 3), -1)}
    ran = jax.jit(lambda m: on_shortest_prefix(
        lambda cut: jnp.int32(cut["segment_ids"].shape[-1]), lambda _: jnp.int32(0), m,
        prefix_lengths(ROW, 2)))(micro)
    assert int(ran) == expected


def test_per_token_outputs_are_zero_past_the_prefix():
    """scan_row_groups pads a prefix's outputs back to the row with zeros, and gives the
    values the whole row gives before that."""
    seg = np.zeros((2, ROW), np.int32)
    seg[0, :700], seg[1, :300] = 1, 1
    batch = {"tokens": jnp.asarray(np.arange(2 * ROW, dtype=np.int32).reshape(2, ROW)),
             "segment_ids": jnp.asarray(seg)}

    def fn(micro):  # a per-token value, and the row length it ran at in every slot
        return micro["tokens"] + 0.0 * micro["segment_ids"].shape[-1]

    whole = jax.jit(lambda b: scan_row_groups(fn, b, None, 0))(batch)
    cut = jax.jit(lambda b: scan_row_groups(fn, b, None, 2))(batch)
    np.testing.assert_array_equal(cut[0], whole[0])  # 700 tokens: the whole row
    np.testing.assert_array_equal(cut[1, :512], whole[1, :512])  # 300 tokens: 512
    np.testing.assert_array_equal(cut[1, 512:], 0.0)


def _sample(rng, length, traj_id):
    mask = np.zeros(length)
    mask[length // 3:] = 1
    return Sample(tokens=rng.integers(1, 64, length), loss_mask=mask,
                  old_logprobs=mask * rng.uniform(-4.6, -3.7, length),
                  advantages=mask * rng.normal(),
                  ref_logprobs=mask * rng.uniform(-4.5, -3.8, length),
                  traj_id=traj_id, prompt_len=length // 3)


def _rows(rng, row_samples: list[list[int]]) -> dict[str, np.ndarray]:
    """Rows of ``ROW`` tokens, row r packed with samples of the given lengths."""
    rows = []
    for r, lengths in enumerate(row_samples):
        samples = [_sample(rng, n, 10 * r + i) for i, n in enumerate(lengths)]
        rows.append(pack_samples(samples, micro_batch_max_tokens=ROW, sequence_length=ROW,
                                 num_rows=1).device_arrays())
    return {k: np.concatenate([r[k] for r in rows]) for k in BATCH_KEYS}


def _config(halvings: int):
    packing = PackingConfig(micro_batch_max_tokens=ROW, sequence_length=ROW, rows_bucket=0,
                            fixed_rows=False, row_prefixes=halvings)
    return dataclasses.replace(BASE, packing=packing)


@functools.cache
def _loss_and_grads(halvings: int):
    return jax.jit(make_loss_and_grads(GRAPHDEF, _config(halvings)))


def test_prefixes_keep_the_loss_gradients_and_logprobs():
    """A full row, a row whose last token ends exactly at 512 (cut to 512), one ending at
    513 (whole row) and one of 200 tokens (cut to 512): the loss, its gradient and the
    per-token logprobs equal the whole-row computation's. An off-by-one cut would drop a
    real token: its loss term and its gradient."""
    rng = np.random.default_rng(0)
    batch = _rows(rng, [[600, 400], [300, 212], [300, 213], [200]])
    assert list((batch["segment_ids"] > 0).sum(axis=1)) == [1000, 512, 513, 200]
    (grads_0, sums_0, den_0), (grads_2, sums_2, den_2) = (
        _loss_and_grads(h)(PARAMS, batch, 0.1) for h in (0, 2))
    assert float(den_2) == float(den_0) > 0
    assert float(sums_2.objective) == pytest.approx(float(sums_0.objective), rel=1e-6)
    assert float(sums_2.tokens) == float(sums_0.tokens)
    assert rel_err(grads_2, grads_0) <= 1e-6

    one = make_mesh(devices=jax.devices()[:1])
    shardings = train_state_shardings(init_train_state(PARAMS, BASE), one).params
    logprobs = [np.asarray(make_compute_logprobs(GRAPHDEF, _config(h), one, shardings)(
        PARAMS, {k: batch[k] for k in LOGPROB_BATCH_KEYS})) for h in (0, 2)]
    np.testing.assert_allclose(logprobs[1], logprobs[0], rtol=1e-6, atol=1e-6)
    assert np.count_nonzero(logprobs[0]) > 0


def test_computed_slots_count_each_groups_prefix():
    """Rows of 1,000 / 512 / 513 / 200 real tokens and an empty one compute 1,024 + 512 +
    1,024 + 512 + 0 slots with two halvings (4 × 1,024 without)."""
    rng = np.random.default_rng(1)
    seg = np.concatenate([_rows(rng, [[600, 400], [300, 212], [300, 213], [200]])[
        "segment_ids"], np.zeros((1, ROW), np.int32)])
    batch = pack_samples([_sample(rng, 10, 0)], micro_batch_max_tokens=ROW,
                         sequence_length=ROW, num_rows=5)
    batch = dataclasses.replace(batch, segment_ids=seg)
    one = make_mesh(devices=jax.devices()[:1])
    assert computed_slots(batch, one, 2) == 1024 + 512 + 1024 + 512
    assert computed_slots(batch, one, 0) == 4 * 1024
    # A mini-batch of one group is differentiated whole, without a prefix.
    single = pack_samples([_sample(rng, 300, 0)], micro_batch_max_tokens=ROW,
                          sequence_length=ROW, num_rows=1)
    assert computed_slots(single, one, 2) == ROW


def test_negative_row_prefixes_is_a_one_line_error():
    with pytest.raises(ValueError, match="row_prefixes: must be >= 0"):
        PackingConfig(row_prefixes=-1)
