"""What the learner compares between sampler and learner: only tokens both can speak for.

* A sample longer than ``sequence_length`` is trained on its first ``sequence_length`` tokens;
  the learner's per-token values are 0 beyond. TIS weights, the logprob mismatch and the KL
  folded into the rewards must not read those zeros as logprobs.
* Under a top-k/top-p restriction a token outside the kept set has the sentinel
  ``OUT_OF_SUPPORT_LOGPROB``, not a logprob: it is masked, never used as −1e4, and the
  reference is taken on its full softmax (it has no sentinel to give).
"""

import dataclasses
import types

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from jaxrl_agentic.algos.losses import policy_loss
from jaxrl_agentic.data import PackingConfig, Sample
from jaxrl_agentic.data.trajectory import Trajectory, Turn
from jaxrl_agentic.models.config import ModelConfig
from jaxrl_agentic.models.transformer import Transformer
from jaxrl_agentic.pipeline import Pipeline
from jaxrl_agentic.training.learner import Learner
from jaxrl_agentic.training.learner_config import LearnerConfig
from jaxrl_agentic.training.off_policy import (
    logprob_mismatch,
    out_of_support_tokens,
    sample_importance_weights,
)
from pallas_kernels import OUT_OF_SUPPORT_LOGPROB


def on_policy_sample(length=96, prompt=8, seed=0):
    rng = np.random.default_rng(seed)
    mask = np.zeros(length)
    mask[prompt:] = 1
    return Sample(tokens=rng.integers(1, 64, length), loss_mask=mask,
                  old_logprobs=mask * rng.uniform(-3.0, -1.0, length),
                  advantages=mask.copy(), traj_id=0, prompt_len=prompt)


def learner_view(sample, sequence_length):
    """What ``Learner.sample_logprobs`` returns for an exactly on-policy sample: the same
    logprobs on the trained tokens, 0 from ``sequence_length`` on."""
    out = np.array(sample.old_logprobs, np.float32)
    out[sequence_length:] = 0.0
    return out


def tis_config(level, mode, sequence_length=64):
    return LearnerConfig(recompute_old_logprobs=True, tis_imp_ratio_cap=2.0, tis_level=level,
                         tis_mode=mode, packing=PackingConfig(
                             micro_batch_max_tokens=128, sequence_length=sequence_length))


@pytest.mark.parametrize("level", ["token", "sequence", "geometric"])
@pytest.mark.parametrize("mode", ["truncate", "mask"])
def test_a_truncated_on_policy_sample_has_unit_weights_and_no_mismatch(level, mode):
    # 96 tokens, sequence_length 64: read as logprobs, the cut tail's zeros would give the
    # sequence weight min(e^{Σ 1..3}, 2) = 2 (truncate) or 0 (mask) and a mismatch ~1.
    sample = on_policy_sample()
    recomputed = [learner_view(sample, 64)]
    weights, stats = sample_importance_weights([sample], recomputed, tis_config(level, mode))
    np.testing.assert_allclose(weights[0][8:64], 1.0, rtol=1e-6)
    assert not weights[0][64:].any()  # not trained: masked with the cut
    assert stats["off_policy/tis_capped_frac"] == 0.0
    assert logprob_mismatch([sample], recomputed, 64) == 0.0
    assert out_of_support_tokens([sample], recomputed, 64) == 0


def test_an_out_of_support_token_is_masked_not_read_as_minus_1e4():
    # One trained token outside the learner's top-k set: its weight is 0 and the other
    # tokens keep the on-policy weight 1, at every level; the mismatch ignores it and counts
    # it. As a logprob, −1e4 would zero the whole sample's sequence/geometric weight.
    sample = on_policy_sample(length=40)
    recomputed = [learner_view(sample, 40)]
    recomputed[0][20] = OUT_OF_SUPPORT_LOGPROB
    for level in ("token", "sequence", "geometric"):
        weights, _ = sample_importance_weights([sample], recomputed,
                                               tis_config(level, "mask", 40))
        w = weights[0]
        assert w[20] == 0.0
        np.testing.assert_allclose(np.delete(w[8:], 12), 1.0, rtol=1e-6)
    assert logprob_mismatch([sample], recomputed, 40) == 0.0
    assert out_of_support_tokens([sample], recomputed, 40) == 1


def turn(context_len, n, logprob):
    return Turn(context_len=context_len, generated=list(range(1, n + 1)),
                logprobs=np.full(n, logprob, np.float32), stop_reason="eos",
                eos_appended=False, reward=1.0, action=0, action_is_valid=True,
                action_is_effective=True, success=True, done=False, state_hash=b"")


def test_kl_in_reward_reads_neither_the_cut_tail_nor_the_sentinel():
    # Two turns of 30 generated tokens after 10-token prompts (80 tokens), sequence_length
    # 48: the reference equals the sampler on the trained tokens, so the KL is 0 and the
    # rewards stay 1. The tail's zeros read as reference logprobs would cost k3(−3) per
    # token (~17 each); a sentinel sampler logprob would cost ~1e4.
    turns = [turn(10, 30, -3.0), turn(50, 30, -3.0)]
    turns[0].logprobs[5] = OUT_OF_SUPPORT_LOGPROB
    traj = Trajectory(traj_id=0, group_id=0, tag="t", seed=0, tokens=list(range(80)),
                      turns=turns)

    def sample_logprobs(samples, reference):
        assert reference
        out = [np.array(s.old_logprobs, np.float32) for s in samples]
        for o in out:
            o[48:] = 0.0
            o[15] = -3.0  # the reference's own (full-softmax) logprob of that token
        return out

    me = types.SimpleNamespace(
        sequence_length=48,
        config=types.SimpleNamespace(advantages=types.SimpleNamespace(kl_estimator="k3")),
        learner=types.SimpleNamespace(sample_logprobs=sample_logprobs, state=types.SimpleNamespace(
            kl=types.SimpleNamespace(coef=0.1))))
    metrics = Pipeline.fold_kl_into_rewards.__wrapped__(me, [traj])
    assert [u.reward for u in turns] == [1.0, 1.0]
    assert metrics["actor/reward_kl"] == 0.0


def test_the_kl_leaves_out_tokens_outside_the_policys_support():
    # top_k = 1: only the argmax is in the support. Token 1's target is not, so its
    # restricted logprob is the sentinel: the k1/k2/k3 KL must leave it out (not ~1e4).
    rng = np.random.default_rng(0)
    hidden = jnp.asarray(rng.normal(size=(3, 8)), jnp.float32)
    head = jnp.asarray(rng.normal(size=(8, 16)), jnp.float32)
    logits = np.asarray(hidden @ head)
    top = logits.argmax(-1)
    targets = jnp.asarray([top[0], (top[1] + 1) % 16, top[2]])
    full = jax.nn.log_softmax(jnp.asarray(logits))[jnp.arange(3), targets]
    ones = jnp.ones(3)
    for estimator in ("k1", "k2", "k3"):
        sums = policy_loss(hidden, head, targets, jnp.zeros(3), ones, ones, full,
                           kl_coef=1.0, kl_estimator=estimator, top_k=1)
        # In-support tokens: restricted logprob 0 (the kept set is one token).
        x = -np.asarray(full)[[0, 2]]
        expected = {"k1": x.sum(), "k2": (0.5 * x * x).sum(),
                    "k3": (np.exp(-x) + x - 1).sum()}[estimator]
        np.testing.assert_allclose(float(sums.kl), expected, rtol=1e-5)


def test_the_reference_logprobs_are_the_full_softmax_under_the_sampling_filter():
    cfg = ModelConfig(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                      num_attention_heads=4, num_key_value_heads=2, head_dim=8)
    graphdef, params = nnx.split(Transformer(cfg, rngs=nnx.Rngs(0)))
    config = LearnerConfig(init_kl_coef=0.1, top_k=2, logprob_under_sampling_filter=True,
                           recompute_old_logprobs=True, mini_batch_size=2,
                           packing=PackingConfig(micro_batch_max_tokens=32,
                                                 sequence_length=32, rows_bucket=0))
    learner = Learner(graphdef, params, config)
    sample = dataclasses.replace(on_policy_sample(length=20, prompt=4), traj_id=1)
    restricted = learner.sample_logprobs([sample])[0]
    ref = learner.sample_logprobs([sample], reference=True)[0]
    logits = nnx.merge(graphdef, params)(jnp.asarray(sample.tokens)[None],
                                         jnp.arange(20)[None])[0]
    full = np.asarray(jax.nn.log_softmax(logits[:-1]))[np.arange(19), sample.tokens[1:]]
    np.testing.assert_allclose(ref[4:], full[3:], atol=2e-5)
    # Random tokens mostly lie outside a top-2 set: the policy's own logprobs say so.
    assert (restricted[4:] == OUT_OF_SUPPORT_LOGPROB).sum() > 5


def test_mismatch_kl_by_hand():
    """k3 = e^(−x) + x − 1 with x = sampler − learner logprob, over comparable loss tokens:
    x = 0.5 and −0.2 on the two loss tokens (the prompt token and the one past
    `sequence_length` do not count)."""
    from jaxrl_agentic.data import Sample
    from jaxrl_agentic.training.off_policy import mismatch_kl

    sample = Sample(tokens=[1, 2, 3, 4], loss_mask=[0, 1, 1, 1],
                    old_logprobs=[0.0, -1.0, -2.0, -0.5], advantages=[0, 1, 1, 1])
    learner = np.asarray([0.0, -1.5, -1.8, -3.0], np.float32)
    expected = ((np.exp(-0.5) + 0.5 - 1) + (np.exp(0.2) - 0.2 - 1)) / 2
    assert mismatch_kl([sample], [learner], sequence_length=3) == pytest.approx(expected,
                                                                                rel=1e-6)
    assert mismatch_kl([sample], [np.asarray(sample.old_logprobs)], 3) == 0.0


@pytest.mark.parametrize("recompute, tis_cap", [(True, 0.0), (True, 2.0), (False, 0.0)])
def test_a_sentinel_old_logprob_is_masked_not_trained_with_a_ratio_of_e20(recompute, tis_cap):
    # top_k = 63 of 64: every token of the sample is in the policy's support, and the
    # sample is on-policy (its logprobs are the learner's). π_old of token 10 is the
    # sentinel: the learner's recomputation put it outside its kept set (recompute), or the
    # behaviour logprob is one (no recompute). Kept as π_old, that token's ratio in the
    # update is e^min(log π + 1e4, 20) = 4.9e8 (with A = −1 a pg sum of ~4.9e8, its
    # gradient 0); masked, it leaves the loss and every other ratio is 1.
    cfg = ModelConfig(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                      num_attention_heads=4, num_key_value_heads=2, head_dim=8)
    graphdef, params = nnx.split(Transformer(cfg, rngs=nnx.Rngs(0)))
    config = LearnerConfig(top_k=63, logprob_under_sampling_filter=True,
                           recompute_old_logprobs=recompute, tis_imp_ratio_cap=tis_cap,
                           mini_batch_size=1, packing=PackingConfig(
                               micro_batch_max_tokens=32, sequence_length=32, rows_bucket=0))
    learner = Learner(graphdef, params, config)
    sample = on_policy_sample(length=20, prompt=4, seed=0)
    own = learner.sample_logprobs([sample])[0]
    assert (own[4:] > OUT_OF_SUPPORT_LOGPROB / 2).all()
    sentinel = own.copy()
    sentinel[10] = OUT_OF_SUPPORT_LOGPROB
    sample = dataclasses.replace(sample, old_logprobs=own if recompute else sentinel,
                                 advantages=-sample.loss_mask)
    learner.sample_logprobs = lambda samples, reference=False: [
        sentinel if recompute else own for _ in samples]
    trained = []
    run = learner.engine.run
    learner.engine.run = lambda samples, lrs: (trained.extend(samples), run(samples, lrs))[1]
    metrics = learner.step([sample], [1e-3])
    assert trained[0].loss_mask[10] == 0 and trained[0].loss_mask[4:].sum() == 15
    assert metrics["tokens/loss"] == 15  # 16 generated tokens, one masked
    assert metrics["rollout/out_of_support_tokens"] == 1
    # Step 0 on-policy: ratio 1 on each kept token; pg = −A·ratio = 1 per token (token mean).
    assert metrics["actor/ratio"] == pytest.approx(1.0, abs=1e-5)
    assert metrics["actor/pg_loss"] == pytest.approx(1.0, abs=1e-5)
    assert metrics["actor/clipfrac"] == 0.0
