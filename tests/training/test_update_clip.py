"""The relative gradient clip (`update.clip_by_relative_global_norm`).

The full-reply FrozenLake recipe did not learn at `max_grad_norm` 1.0: a token mean over a
four-token reply scales the gradient down, so a fixed clip that normalised every update of
the one-token recipe normalised none of the full-reply one's and let its spikes through.
The relative clip follows the gradient's own scale; these tests check it against a NumPy
reference and show the invariance the fixed clip lacks.
"""

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

from jaxrl_agentic.training.update import UpdateConfig, clip_by_relative_global_norm, make_optimizer

# A stream of gradient norms with two spikes (20× and 8× the typical 0.4).
NORMS = [0.5, 0.3, 0.4, 8.0, 0.35, 0.45, 3.2, 0.4]


def gradient(norm: float, seed: int) -> dict:
    """A two-leaf gradient of global norm `norm`, direction fixed by `seed`."""
    rng = np.random.default_rng(seed)
    leaves = {"w": rng.normal(size=(3, 4)), "b": rng.normal(size=(4,))}
    total = np.sqrt(sum((v ** 2).sum() for v in leaves.values()))
    return {k: jnp.asarray(v * norm / total, jnp.float32) for k, v in leaves.items()}


def reference_clipped_norms(norms, factor, decay):
    """The docstring's formula, written out in NumPy float64."""
    ema, out = 0.0, []
    for t, norm in enumerate(norms):
        threshold = np.inf if t == 0 else factor * np.exp(ema / (1 - decay ** t))
        out.append(min(norm, threshold))
        ema = decay * ema + (1 - decay) * np.log(norm)
    return out


@pytest.mark.parametrize("factor, decay", [(1.0, 0.95), (2.0, 0.5)])
def test_clipped_norms_follow_the_formula_and_keep_the_direction(factor, decay):
    clip = clip_by_relative_global_norm(factor, decay)
    update = jax.jit(clip.update)
    state = clip.init(None)
    expected = reference_clipped_norms(NORMS, factor, decay)
    for t, norm in enumerate(NORMS):
        g = gradient(norm, t)
        clipped, state = update(g, state)
        assert float(optax.tree.norm(clipped)) == pytest.approx(expected[t], rel=1e-5)
        cosine = sum(float(jnp.vdot(clipped[k], g[k])) for k in g) / (
            float(optax.tree.norm(clipped)) * norm)
        assert cosine == pytest.approx(1.0, abs=1e-6)
    # The spikes were cut to a few times the typical norm; the first update passed as it was.
    assert expected[0] == NORMS[0] and expected[3] < NORMS[3] / 5 and expected[6] < NORMS[6] / 2


def adam_updates(config: UpdateConfig, scale: float) -> list:
    """Parameter updates of `make_optimizer(config)` on the stream NORMS times `scale`."""
    params = gradient(1.0, 99)
    tx = make_optimizer(config)
    state = tx.init(params)
    out = []
    for t, norm in enumerate(NORMS):
        updates, state = tx.update(gradient(norm * scale, t), state, params)
        out.append(np.concatenate([np.ravel(v) for v in jax.tree.leaves(updates)]))
    return out


def test_updates_do_not_depend_on_the_gradient_scale_with_the_relative_clip():
    """A token mean over a reply of 4 loss tokens where 1 carries the signal gives the
    gradient of the one-token reply ÷ 4. With the relative clip AdamW takes the same steps
    either way; with the fixed clip at 1.0 it does not (the one-token stream's spikes are
    clipped, the quartered stream's are not): the cause of the full-reply stall."""
    relative = UpdateConfig(learning_rate=1e-3, max_grad_norm=None, relative_grad_clip=1.0)
    one, four = adam_updates(relative, 1.0), adam_updates(relative, 0.25)
    for a, b in zip(one, four, strict=True):
        np.testing.assert_allclose(a, b, rtol=1e-4, atol=1e-9)
    fixed = UpdateConfig(learning_rate=1e-3, max_grad_norm=1.0)
    one, four = adam_updates(fixed, 1.0), adam_updates(fixed, 0.25)
    assert max(np.abs(a - b).max() / np.abs(a).max() for a, b in zip(one, four, strict=True)) > 0.1


def test_relative_clip_off_by_default_and_validated():
    # Off: the optimizer state is the fixed clip's and AdamW's, as before.
    params = gradient(1.0, 0)
    default_state = make_optimizer(UpdateConfig()).init(params)
    assert isinstance(default_state[0], optax.EmptyState)
    with pytest.raises(ValueError, match="relative_grad_clip: must be > 0"):
        UpdateConfig(relative_grad_clip=-1.0)
