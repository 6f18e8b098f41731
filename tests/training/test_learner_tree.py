"""Tree packing gives the flat layout's loss and gradients (relative 1e-5) for every policy
loss and reduction, and the learner's logprobs per sample are the flat layout's."""

import dataclasses

import numpy as np
import pytest

from jaxrl_agentic.algos.reductions import REDUCTIONS
from jaxrl_agentic.data import Sample, pack_samples
from jaxrl_agentic.data.packing import pack_tree
from jaxrl_agentic.runtime.parallel import make_mesh
from jaxrl_agentic.training.learner import Learner
from tests.training.test_learner import (
    BATCH_KEYS,
    GRAPHDEF,
    PARAMS,
    ROW_LEN,
    jitted_loss_and_grads,
    loss_config,
    rel_err,
)


def group_samples(seed=0):
    """Two groups (prompts of 8 and 5 tokens; 3 and 2 members, one with a masked
    observation between two replies) and a sample of its own: 71 tokens, 17 of them shared."""
    rng = np.random.default_rng(seed)
    samples = []
    for g, (prompt, tails) in enumerate([(8, (5, 7, 4)), (5, (9, 11))]):
        head = rng.integers(1, 64, prompt)
        for m, tail in enumerate(tails):
            tokens = np.concatenate([head, rng.integers(1, 64, tail)])
            mask = np.zeros(len(tokens))
            mask[prompt:] = 1
            if tail == 9:
                mask[prompt + 3:prompt + 5] = 0
            samples.append(Sample(
                tokens=tokens, loss_mask=mask,
                old_logprobs=mask * rng.uniform(-4.6, -3.7, len(tokens)),
                advantages=mask * (rng.normal() + 0.3 * rng.normal(size=len(tokens))),
                ref_logprobs=mask * rng.uniform(-4.5, -3.8, len(tokens)),
                traj_id=10 * g + m, prompt_len=prompt))
    mask = np.r_[np.zeros(3), np.ones(7)]
    samples.append(Sample(tokens=rng.integers(1, 64, 10), loss_mask=mask,
                          old_logprobs=-4 * mask, advantages=0.5 * mask,
                          ref_logprobs=-4.1 * mask, traj_id=99, prompt_len=3))
    return samples


SAMPLES = group_samples()


def batches():
    flat = pack_samples(SAMPLES, micro_batch_max_tokens=ROW_LEN, sequence_length=ROW_LEN,
                        num_rows=2)
    tree = pack_tree(SAMPLES, micro_batch_max_tokens=ROW_LEN, sequence_length=ROW_LEN,
                     num_rows=2)
    assert tree.shared_saved == 7 * 2 + 4 * 1
    # The flat layout with prefix ids of 0 (none: attention is the flat one to the bit,
    # tests/pallas_kernels) runs through the same compiled program as the tree layout.
    flat_arrays = {**flat.device_arrays(), "prefix_ids": np.zeros_like(flat.segment_ids)}
    keys = BATCH_KEYS + ("prefix_ids",)
    return ({k: flat_arrays[k] for k in keys}, {k: tree.device_arrays()[k] for k in keys})


@pytest.mark.parametrize("reduction,policy_loss",
                         [(r, "ppo") for r in REDUCTIONS]
                         + [("token_mean", "gspo"), ("seq_mean_token_mean", "cispo")])
def test_tree_loss_and_gradients_equal_the_flat_layouts(reduction, policy_loss):
    flat, tree = batches()
    fn = jitted_loss_and_grads(reduction, policy_loss)
    results = []
    for batch in (flat, tree):
        grads, sums, denominator = fn(PARAMS, batch, 0.1)
        results.append((float(sums.objective), float(denominator), grads))
    (obj_f, den_f, grads_f), (obj_t, den_t, grads_t) = results
    assert den_t == den_f
    assert obj_t == pytest.approx(obj_f, rel=1e-5)
    assert rel_err(grads_t, grads_f) <= 1e-5


def test_learner_logprobs_per_sample_equal_the_flat_layouts():
    config = loss_config("token_mean")
    packing = dataclasses.replace(config.packing, share_group_prefix=True)
    learners = [Learner(GRAPHDEF, PARAMS, dataclasses.replace(config, packing=p), make_mesh())
                for p in (config.packing, packing)]
    flat, tree = (learner.sample_logprobs(SAMPLES) for learner in learners)
    for s, a, b in zip(SAMPLES, flat, tree, strict=True):
        generated = s.loss_mask > 0
        np.testing.assert_allclose(b[generated], a[generated], rtol=1e-5, atol=1e-6)
        assert np.all(a[generated] < 0)


def test_without_its_prefix_ids_the_tree_layout_is_not_the_flat_one():
    """The control: continuations that do not read their prompt give another loss."""
    flat, tree = batches()
    fn = jitted_loss_and_grads("token_mean", "ppo")
    blind = {**tree, "prefix_ids": np.zeros_like(tree["prefix_ids"])}
    assert abs(float(fn(PARAMS, blind, 0.1)[1].objective)
               - float(fn(PARAMS, flat, 0.1)[1].objective)) > 1e-3
