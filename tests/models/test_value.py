"""The GAE critic: value head formula, the token shift, and GAE fed from its values."""

import jax.numpy as jnp
import numpy as np
from flax import nnx

from jaxrl_agentic.algos.advantages import gae
from jaxrl_agentic.algos.estimators import AdvantageSettings, token_advantages
from jaxrl_agentic.models import ModelConfig
from jaxrl_agentic.models.value import ValueModel, state_values
from tests.data.test_samples import make_traj

CFG = ModelConfig(vocab_size=128, hidden_size=32, intermediate_size=64, num_hidden_layers=1,
                  num_attention_heads=4, num_key_value_heads=2, head_dim=8)


def test_value_head_and_shift():
    critic = ValueModel(CFG, rngs=nnx.Rngs(0))
    tokens = jnp.arange(10)[None] % 128
    pos = jnp.arange(10)[None]
    assert np.all(np.asarray(critic.values(tokens, pos)) == 0)  # zero-initialised head
    w = np.random.default_rng(0).normal(size=(32, 1)).astype(np.float32)
    critic.head.kernel[...] = jnp.asarray(w)
    critic.head.bias[...] = jnp.asarray([0.5])
    hidden = np.asarray(critic.backbone.hidden_states(tokens, pos))
    v = np.asarray(critic.values(tokens, pos))
    np.testing.assert_allclose(v, hidden @ w[:, 0] + 0.5, atol=1e-5)
    shifted = np.asarray(state_values(jnp.asarray(v)))
    np.testing.assert_allclose(shifted[0, 1:], v[0, :-1])
    assert shifted[0, 0] == 0


def test_gae_from_critic_values_on_a_trajectory():
    traj = make_traj([([10, 11], True), ([12], True)])
    traj.turns[0].reward, traj.turns[1].reward = 0.0, 1.0
    n = traj.turns[-1].context_len + 1
    values = np.linspace(0.1, 0.9, n).astype(np.float32)
    adv, ret = token_advantages([traj], adv_estimator="gae",
                                settings=AdvantageSettings(gamma=0.9, lambd=0.8),
                                values=[values])
    mask = traj.loss_mask()[:n]
    rewards = np.zeros(n, np.float32)
    rewards[traj.turns[0].context_len + 1] = 0.0
    rewards[traj.turns[1].context_len] = 1.0  # a turn's reward sits on its last token
    ref_a, ref_r = gae(rewards, values, mask, gamma=0.9, lam=0.8)
    np.testing.assert_allclose(adv[0], ref_a, atol=1e-6)
    np.testing.assert_allclose(ret[0], ref_r, atol=1e-6)
    assert (adv[0][mask == 0] == 0).all() and (adv[0][mask > 0] != 0).all()
