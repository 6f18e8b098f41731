"""The output head's own learning rate (`UpdateConfig.head_learning_rate`).

Reference: AdamW is per-leaf, so without a global clip the head trained at its own LR is
plain `optax.adamw` run on the head alone at that LR (and the rest at the run's LR), with
the scheduled LR changing between updates in the same ratio.
"""

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

from jaxrl_agentic.training.update import (
    UpdateConfig,
    init_optimizer_state,
    make_optimizer,
    set_learning_rate,
)

LRS = [1e-3, 3e-3, 2e-3]  # a schedule: the LR each update is given


def params() -> dict:
    rng = np.random.default_rng(0)
    return {"lm_head": {"kernel": jnp.asarray(rng.normal(size=(4, 6)), jnp.float32)},
            "body": {"w": jnp.asarray(rng.normal(size=(4, 4)), jnp.float32),
                       "scale": jnp.asarray(rng.normal(size=(4,)), jnp.float32)}}


def grads(t: int) -> dict:
    rng = np.random.default_rng(t + 1)
    return jax.tree.map(lambda p: jnp.asarray(rng.normal(size=p.shape), jnp.float32), params())


def reference(part: str, lr_scale: float) -> dict:
    """`optax.adamw` on one part of the tree alone, LR = schedule × lr_scale."""
    p = params()[part]
    mask = jax.tree.map(lambda x: x.ndim >= 2, p)
    state = optax.adamw(1.0, weight_decay=0.1, mask=mask).init(p)
    for t, lr in enumerate(LRS):  # Adam's state does not hold the LR: a new one each update
        tx = optax.adamw(lr * lr_scale, weight_decay=0.1, mask=mask)
        updates, state = tx.update(grads(t)[part], state, p)
        p = optax.apply_updates(p, updates)
    return p


@pytest.mark.parametrize("head_lr", [3e-4, 1e-3])
def test_the_head_trains_at_its_own_rate_on_the_same_schedule(head_lr):
    config = UpdateConfig(learning_rate=1e-3, head_learning_rate=head_lr, max_grad_norm=None,
                          weight_decay=0.1)
    tx = make_optimizer(config)
    p = params()
    state = init_optimizer_state(p, config)
    for t, lr in enumerate(LRS):
        state = set_learning_rate(state, lr)
        updates, state = tx.update(grads(t), state, p)
        p = optax.apply_updates(p, updates)
    ratio = head_lr / config.learning_rate
    for part, scale in (("lm_head", ratio), ("body", 1.0)):
        expected = reference(part, scale)
        for got, want in zip(jax.tree.leaves(p[part]), jax.tree.leaves(expected), strict=True):
            np.testing.assert_allclose(got, want, rtol=1e-6, atol=1e-7)
    # The head really moved at another rate than the rest would have moved it.
    if ratio != 1.0:
        same_rate = reference("lm_head", 1.0)
        assert not np.allclose(p["lm_head"]["kernel"], same_rate["kernel"], atol=1e-5)


def test_a_head_lr_without_a_trained_head_is_a_one_line_error():
    config = UpdateConfig(learning_rate=1e-3, head_learning_rate=3e-4)
    tied = {"embed": {"embedding": jnp.zeros((6, 4))}, "body": params()["body"]}
    with pytest.raises(ValueError, match="^head_learning_rate: the model has no output head"):
        init_optimizer_state(tied, config)
    with pytest.raises(ValueError, match="head_learning_rate"):
        UpdateConfig(learning_rate=1e-3, head_learning_rate=-1.0)
