"""The GAE critic against independent references.

* ``sample_values`` on packed rows = ``ValueModel.values`` + ``state_values`` of each sample
  run alone (the shift must not cross packed segments).
* Gradient: the accumulated value-loss gradient over 1 or 3 micro-batches, and a whole
  ``Critic.step`` (metrics and the AdamW update), equal ``jax.grad`` of a per-sample loop.
* Fitting: repeated steps drive the value loss down on a constant target.
* ``token_estimator_samples`` (GAE) = ``gae()`` on hand-built trajectories with the critic's values.

Tiny model (vocab 64, hidden 32, 1 layer).
"""

import dataclasses
import functools

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import nnx

from jaxrl_agentic.algos.advantages import gae
from jaxrl_agentic.algos.estimators import AdvantageSettings
from jaxrl_agentic.data import PackingConfig, Sample, pack_samples
from jaxrl_agentic.models.config import ModelConfig
from jaxrl_agentic.models.transformer import Transformer
from jaxrl_agentic.models.value import state_values
from jaxrl_agentic.pipeline import token_estimator_samples
from jaxrl_agentic.training.critic import (
    Critic,
    CriticConfig,
    init_critic_state,
    make_value_loss_and_grads,
)
from jaxrl_agentic.training.update import make_optimizer, set_learning_rate
from tests.data.test_samples import EOS, make_traj

MODEL_CFG = ModelConfig(
    vocab_size=64,
    hidden_size=32,
    intermediate_size=64,
    num_hidden_layers=1,
    num_attention_heads=4,
    num_key_value_heads=2,
    head_dim=8,
)
POLICY_GRAPHDEF, POLICY_PARAMS = nnx.split(Transformer(MODEL_CFG, rngs=nnx.Rngs(0)))
ROW_LEN = 64
PAD_LEN = 32  # every reference sequence is padded to this (causal: padding is invisible)
CLIP = 0.2
# Rows of 16 tokens: the test samples take 3 micro-batches (4 rows once bucketed).
STEP_CONFIG = dict(micro_batch_max_tokens=16, sequence_length=16, mini_batch_size=5,
                   ppo_epochs=1, weight_decay=0.01)
PACKING_FIELDS = ("micro_batch_max_tokens", "sequence_length", "rows_bucket", "fixed_rows")


def make_critic(random_head=True, **overrides) -> Critic:
    """A critic, by default with a random value head (a zero head would give zero backbone
    gradients and all-zero values, hiding alignment errors)."""
    settings = {"learning_rate": 1e-3, "max_grad_norm": 1.0, "value_clip": CLIP,
                "micro_batch_max_tokens": ROW_LEN, "sequence_length": ROW_LEN,
                "rows_bucket": 0, "fixed_rows": False, "mini_batch_size": 8, **overrides}
    packing = PackingConfig(**{k: settings.pop(k) for k in PACKING_FIELDS})
    config = CriticConfig(packing=packing, **settings)
    critic = Critic(POLICY_GRAPHDEF, POLICY_PARAMS, config)
    model = nnx.merge(critic.graphdef, critic.params)
    assert np.all(np.asarray(model.head.kernel[...]) == 0)  # zero-initialised head
    if not random_head:
        return critic
    rng = np.random.default_rng(1)
    model.head.kernel[...] = jnp.asarray(rng.normal(size=(32, 1)), jnp.float32)
    model.head.bias[...] = jnp.asarray([0.3], jnp.float32)
    _, params = nnx.split(model)
    critic.state = jax.device_put(init_critic_state(params, config), critic.state_shardings)
    return critic


@functools.cache
def value_graphdef():
    return make_critic().graphdef


@functools.partial(jax.jit, static_argnums=0)
def _reference_values(graphdef, params, tokens):
    model = nnx.merge(graphdef, params)
    after = model.values(tokens[None], jnp.arange(PAD_LEN)[None])
    return state_values(after)[0]


def reference_values(graphdef, params, tokens) -> jnp.ndarray:
    """``[len(tokens)]`` V_k of one sequence run alone: ``values`` then ``state_values``."""
    n = len(tokens)
    return _reference_values(graphdef, params, jnp.asarray(np.pad(tokens, (0, PAD_LEN - n))))[:n]


def make_samples(critic, seed=0):
    """Five samples (one multi-turn with a masked observation, one fully masked); old values
    near the critic's current V so that value clipping is active on some tokens only."""
    rng = np.random.default_rng(seed)
    lengths, prompts = [9, 7, 12, 6, 10], [3, 2, 4, 2, 3]
    samples = []
    for i, (length, prompt) in enumerate(zip(lengths, prompts, strict=True)):
        tokens = rng.integers(1, 64, length)
        mask = np.zeros(length)
        mask[prompt:] = 1
        if i == 2:
            mask[7:9] = 0
        if i == 3:
            mask[:] = 0
        v = np.asarray(reference_values(critic.graphdef, critic.params, tokens))
        samples.append(
            Sample(
                tokens=tokens,
                loss_mask=mask,
                old_logprobs=np.zeros(length),
                advantages=np.zeros(length),
                returns=mask * (v + rng.normal(size=length)),
                values=mask * (v + 0.3 * rng.normal(size=length)),
                traj_id=i,
                prompt_len=prompt,
            )
        )
    return samples


def _reference_loss(params, graphdef, padded, clip_eps):
    """Token mean over the mini-batch of ½·max((V−R)², (V_old + clip(V−V_old, ±ε) − R)²),
    with each sample alone in its own row (right-padded to PAD_LEN with mask 0)."""
    tokens, mask, r, old = padded
    model = nnx.merge(graphdef, params)
    positions = jnp.broadcast_to(jnp.arange(PAD_LEN), tokens.shape)
    v = state_values(model.values(tokens, positions))
    v_clip = old + jnp.clip(v - old, -clip_eps, clip_eps)
    per_token = 0.5 * jnp.maximum((v - r) ** 2, (v_clip - r) ** 2)
    return jnp.sum(mask * per_token) / jnp.sum(mask)


_reference_value_and_grad = jax.jit(jax.value_and_grad(_reference_loss), static_argnums=(1, 3))


def reference_value_and_grad(params, graphdef, samples, clip_eps):
    fields = ("tokens", "loss_mask", "returns", "values")
    padded = tuple(np.stack([np.pad(getattr(s, f), (0, PAD_LEN - len(s))) for s in samples])
                   for f in fields)
    return _reference_value_and_grad(params, graphdef, padded, clip_eps)


def reference_clipfrac(params, graphdef, samples, clip_eps):
    hits, count = 0, 0
    for s in samples:
        v = np.asarray(reference_values(graphdef, params, s.tokens))
        v_clip = s.values + np.clip(v - s.values, -clip_eps, clip_eps)
        on = s.loss_mask > 0
        hits += int(((v_clip - s.returns) ** 2 > (v - s.returns) ** 2)[on].sum())
        count += int(on.sum())
    return hits / count


def rows_batch(samples, groups, n_rows):
    """``[n_rows, ROW_LEN]`` arrays: group ``g`` packed into row ``g``, the rest padding."""
    rows = [
        pack_samples([samples[i] for i in g], micro_batch_max_tokens=ROW_LEN,
                     sequence_length=ROW_LEN, num_rows=1).token_arrays()
        for g in groups
    ]
    return {k: np.pad(np.concatenate([r[k] for r in rows]), ((0, n_rows - len(rows)), (0, 0)))
            for k in rows[0]}


def rel_err(a, b):
    diff = jax.tree.map(lambda x, y: x - y, a, b)
    return float(optax.tree.norm(diff) / optax.tree.norm(b))


# ----------------------------------------------------------------------------- tests


def test_sample_values_match_the_value_model_on_each_sample_alone():
    critic = make_critic(micro_batch_max_tokens=32, sequence_length=16)
    rng = np.random.default_rng(3)
    lengths = [9, 7, 12, 5, 20, 3]
    samples = [Sample(tokens=rng.integers(1, 64, n), loss_mask=np.zeros(n),
                      old_logprobs=np.zeros(n), advantages=np.zeros(n)) for n in lengths]
    batch = pack_samples(samples, micro_batch_max_tokens=32, sequence_length=16)
    assert (batch.segment_ids.max(axis=1) >= 2).any()  # segments do share rows
    out = critic.sample_values(samples)
    for s, v in zip(samples, out, strict=True):
        assert v.shape == (len(s),) and v.dtype == np.float32
        n = min(len(s), 16)  # the 20-token sample is cut to sequence_length
        ref = np.asarray(reference_values(critic.graphdef, critic.params, s.tokens[:n]))
        assert v[0] == 0 and np.all(ref[1:] != 0)
        np.testing.assert_allclose(v[:n], ref, atol=1e-5)
        assert np.all(v[n:] == 0)


def test_value_loss_gradient_over_1_and_3_micro_batches_equals_reference():
    critic = make_critic()
    samples = make_samples(critic)
    graphdef, params = critic.graphdef, critic.params
    ref_loss, ref_grads = reference_value_and_grad(params, graphdef, samples, CLIP)
    clipfrac = reference_clipfrac(params, graphdef, samples, CLIP)
    assert 0.1 < clipfrac < 0.9  # both branches of the max are exercised
    loss_and_grads = jax.jit(make_value_loss_and_grads(graphdef, critic.config))
    layouts = {1: [range(5)], 3: [[0, 1], [2, 3], [4]]}
    for n, groups in layouts.items():
        grads, sums, denominator = loss_and_grads(params, rows_batch(samples, groups, 3))
        assert float(denominator) == sum(s.loss_mask.sum() for s in samples)
        assert float(sums.loss_sum / denominator) == pytest.approx(float(ref_loss), rel=1e-5), n
        assert float(sums.clipfrac / sums.tokens) == pytest.approx(clipfrac), n
        assert rel_err(grads, ref_grads) <= 1e-5, n
        assert optax.tree.norm(grads["head"]) > 0 and optax.tree.norm(grads["backbone"]) > 0


def test_critic_step_applies_adamw_to_the_reference_gradient():
    critic = make_critic(**STEP_CONFIG)
    samples = make_samples(critic)
    graphdef, params = critic.graphdef, jax.tree.map(jnp.copy, critic.params)
    ref_loss, ref_grads = reference_value_and_grad(params, graphdef, samples, CLIP)
    metrics = critic.step(samples, 1e-3)
    assert metrics["critic/value_loss"] == pytest.approx(float(ref_loss), rel=1e-5)
    assert metrics["critic/grad_norm"] == pytest.approx(float(optax.tree.norm(ref_grads)),
                                                        rel=1e-5)
    assert metrics["critic/clipfrac"] == pytest.approx(
        reference_clipfrac(params, graphdef, samples, CLIP))
    on = [s.loss_mask > 0 for s in samples]
    returns = np.concatenate([s.returns[m] for s, m in zip(samples, on, strict=True)])
    values = np.concatenate([
        np.asarray(reference_values(graphdef, params, s.tokens))[m]
        for s, m in zip(samples, on, strict=True)])
    assert metrics["critic/returns_mean"] == pytest.approx(returns.mean(), rel=1e-5)
    assert metrics["critic/values_mean"] == pytest.approx(values.mean(), rel=1e-4, abs=1e-6)
    ev = 1 - np.var(returns - values) / np.var(returns)
    assert metrics["critic/explained_variance"] == pytest.approx(ev, rel=1e-4, abs=1e-5)
    # optax's own clip + AdamW on the reference gradient gives the same parameters.
    optimizer = make_optimizer(critic.config)
    opt_state = set_learning_rate(optimizer.init(params), 1e-3)
    updates, _ = optimizer.update(ref_grads, opt_state, params)
    expected = optax.apply_updates(params, updates)
    assert int(critic.state.step) == 1 and int(critic.state.skipped) == 0
    diff = jax.tree.map(lambda a, b: float(jnp.max(jnp.abs(a - b))), critic.params, expected)
    assert max(jax.tree.leaves(diff)) < 1e-6


def test_value_loss_decreases_on_a_constant_target():
    critic = make_critic(random_head=False, **STEP_CONFIG)
    samples = [dataclasses.replace(s, returns=s.loss_mask * 1.5) for s in make_samples(critic)]
    assert all(np.all(v == 0) for v in critic.sample_values(samples))  # zero head: V = 0
    losses = []
    for _ in range(12):
        # Fresh old values each step, as token_estimator_samples would give (clipping stays on).
        values = critic.sample_values(samples)
        samples = [dataclasses.replace(s, values=s.loss_mask * v)
                   for s, v in zip(samples, values, strict=True)]
        metrics = critic.step(samples, 1e-2)
        assert metrics["critic/nonfinite_updates"] == 0
        losses.append(metrics["critic/value_loss"])
    assert losses[-1] < 0.1 * losses[0], losses
    assert metrics["critic/returns_mean"] == pytest.approx(1.5)
    values = critic.sample_values(samples)
    fitted = np.concatenate([v[s.loss_mask > 0] for s, v in zip(samples, values, strict=True)])
    assert np.abs(fitted - 1.5).mean() < 0.3


def test_gae_samples_match_gae_on_hand_built_trajectories():
    critic = make_critic()
    trajs = [
        make_traj([([10, 11], True), ([12, 13, 14], False), ([15], True)], traj_id=0),
        make_traj([([20, 21, 22], False)], traj_id=1, prompt=(1, 2, 3, 4)),
        make_traj([([30], False), ([31, 32], False)], traj_id=2),
    ]
    for traj in trajs:  # the test vocabulary is 64: use 63 as the appended EOS
        traj.tokens = [63 if t == EOS else t for t in traj.tokens]
    for t, rewards in zip(trajs, [(0.5, -1.0, 2.0), (1.0,), (0.0, 3.0)], strict=True):
        for turn, r in zip(t.turns, rewards, strict=True):
            turn.reward = r
    empty = dataclasses.replace(trajs[1], traj_id=3, turns=[])
    samples, metrics = token_estimator_samples(trajs[:2] + [empty] + trajs[2:],
                                               adv_estimator="gae",
                                               settings=AdvantageSettings(gamma=0.9, lambd=0.8),
                                               critic=critic)
    assert [s.traj_id for s in samples] == [0, 1, 2]  # the turn-less trajectory is dropped
    for traj, s in zip(trajs, samples, strict=True):
        end = traj.turns[-1].context_len + len(traj.turns[-1].generated)
        tokens = np.asarray(traj.tokens[:end])
        values = np.asarray(reference_values(critic.graphdef, critic.params, tokens))
        mask = np.zeros(end, np.float32)
        rewards = np.zeros(end, np.float32)
        for turn in traj.turns:
            mask[turn.context_len : turn.context_len + len(turn.generated)] = 1
            rewards[turn.context_len + len(turn.generated) - 1] = turn.reward
        ref_adv, ref_ret = gae(rewards, values, mask, gamma=0.9, lam=0.8)
        np.testing.assert_array_equal(s.tokens, tokens)
        np.testing.assert_array_equal(s.loss_mask, mask)
        np.testing.assert_allclose(s.advantages, ref_adv, atol=1e-5)
        np.testing.assert_allclose(s.returns, ref_ret, atol=1e-5)
        np.testing.assert_allclose(s.values, values * mask, atol=1e-5)
        assert np.all(s.advantages[mask > 0] != 0)
    r = np.concatenate([s.returns[s.loss_mask > 0] for s in samples])
    assert metrics["critic/rollout_returns_mean"] == pytest.approx(r.mean(), rel=1e-5)
