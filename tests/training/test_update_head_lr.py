"""Per-leaf learning rates: the output head's own (`UpdateConfig.head_learning_rate`) and
LoRA+'s for the B adapters (`UpdateConfig.loraplus_lr_ratio`).

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


def lora_params() -> dict:
    rng = np.random.default_rng(2)
    return {"q_proj": {"kernel": jnp.asarray(rng.normal(size=(4, 4)), jnp.float32),
                       "lora_a": jnp.asarray(rng.normal(size=(4, 2)), jnp.float32),
                       "lora_b": jnp.asarray(rng.normal(size=(2, 4)), jnp.float32)}}


def test_loraplus_trains_the_b_adapters_at_ratio_times_the_rate():
    """LoRA+: every B adapter at η·ratio, everything else at η, on the same schedule; the
    reference is plain `optax.adamw` on each leaf alone at its own LR."""
    config = UpdateConfig(learning_rate=1e-3, loraplus_lr_ratio=16.0, max_grad_norm=None)
    tx = make_optimizer(config)
    p = lora_params()
    state = init_optimizer_state(p, config)
    rng = np.random.default_rng(5)
    gs = [jax.tree.map(lambda x: jnp.asarray(rng.normal(size=x.shape), jnp.float32), p)
          for _ in LRS]
    for g, lr in zip(gs, LRS, strict=True):
        state = set_learning_rate(state, lr)
        updates, state = tx.update(g, state, p)
        p = optax.apply_updates(p, updates)
    for name, scale in (("lora_b", 16.0), ("lora_a", 1.0), ("kernel", 1.0)):
        want = lora_params()["q_proj"][name]
        adam_state = optax.adamw(1.0, weight_decay=0.0).init(want)
        for g, lr in zip(gs, LRS, strict=True):
            updates, adam_state = optax.adamw(lr * scale, weight_decay=0.0).update(
                g["q_proj"][name], adam_state, want)
            want = optax.apply_updates(want, updates)
        np.testing.assert_allclose(p["q_proj"][name], want, rtol=1e-6, atol=1e-7)


def test_loraplus_without_adapters_is_a_one_line_error():
    config = UpdateConfig(learning_rate=1e-3, loraplus_lr_ratio=4.0)
    with pytest.raises(ValueError, match="^loraplus_lr_ratio: the model has no LoRA"):
        init_optimizer_state(params(), config)
    with pytest.raises(ValueError, match="loraplus_lr_ratio"):
        UpdateConfig(learning_rate=1e-3, loraplus_lr_ratio=0.0)
