"""The teacher's whole-distribution divergences against a brute force over the vocabulary."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxrl_agentic.algos.teacher_divergence import teacher_divergence

TEMPERATURE = 0.7


def _problem(seed=0, n=7, d=5, d_teacher=3, vocab=11):
    rng = np.random.default_rng(seed)
    f32 = lambda *shape: jnp.asarray(rng.normal(size=shape), jnp.float32)  # noqa: E731
    return f32(n, d), f32(d, vocab), f32(n, d_teacher), f32(d_teacher, vocab) * 2


def _brute_force(hidden, head, teacher_hidden, teacher_head, kind):
    """Per position, over every token, in float64: Σ_v p(v)·(log p(v) − log q(v))."""
    def log_softmax(z):
        z = np.asarray(z, np.float64) / TEMPERATURE
        return z - np.log(np.exp(z - z.max(-1, keepdims=True)).sum(-1, keepdims=True)) \
            - z.max(-1, keepdims=True)
    s = log_softmax(np.asarray(hidden) @ np.asarray(head))
    t = log_softmax(np.asarray(teacher_hidden) @ np.asarray(teacher_head))
    p, lp, lq = (t, t, s) if kind == "forward_kl" else (s, s, t)
    return (np.exp(p) * (lp - lq)).sum(-1)


@pytest.mark.parametrize("kind", ["forward_kl", "reverse_kl"])
@pytest.mark.parametrize("chunk_logits", [1 << 22, 22])  # one chunk; chunks of 2 positions
def test_the_divergence_is_the_full_vocabulary_kl_and_its_gradient_is_the_students(
        kind, chunk_logits):
    hidden, head, teacher_hidden, teacher_head = _problem()
    got = teacher_divergence(hidden, head, teacher_hidden, teacher_head, kind=kind,
                             temperature=TEMPERATURE, chunk_logits=chunk_logits)
    want = _brute_force(hidden, head, teacher_hidden, teacher_head, kind)
    np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-6)
    assert (want > 0).all()

    weights = jnp.linspace(0.0, 1.0, hidden.shape[0])  # a weighted sum, as the loss takes it

    def loss(h, w, th, tw):
        return jnp.sum(weights * teacher_divergence(h, w, th, tw, kind=kind,
                                                    temperature=TEMPERATURE,
                                                    chunk_logits=chunk_logits))

    def plain(h, w):  # the same formula without chunks or checkpointing
        s = jax.nn.log_softmax(h @ w / TEMPERATURE)
        t = jax.nn.log_softmax(teacher_hidden @ teacher_head / TEMPERATURE)
        p, lp, lq = (t, t, s) if kind == "forward_kl" else (s, s, t)
        return jnp.sum(weights * jnp.sum(jnp.exp(p) * (lp - lq), -1))

    grads = jax.grad(loss, argnums=(0, 1, 2, 3))(hidden, head, teacher_hidden, teacher_head)
    expected = jax.grad(plain, argnums=(0, 1))(hidden, head)
    for g, e in zip(grads[:2], expected, strict=True):
        np.testing.assert_allclose(g, e, rtol=1e-4, atol=1e-6)
    assert not np.asarray(grads[2]).any() and not np.asarray(grads[3]).any()  # teacher frozen


def test_the_forward_kl_gradient_is_the_cross_entropy_against_the_teachers_soft_labels():
    """Hand-derived: ∂KL(π_T‖π_s)/∂z = (p_s − p_T)/τ for student logits z = h·W."""
    hidden, head, teacher_hidden, teacher_head = _problem(seed=1)
    z_grad = jax.grad(lambda z: jnp.sum(teacher_divergence(
        jnp.eye(z.shape[0]), z, teacher_hidden, teacher_head, kind="forward_kl",
        temperature=TEMPERATURE)))
    # With hidden = I (n × n), head = logits z [n, V]: row i of z is position i's logits.
    z = hidden @ head
    p_s = jax.nn.softmax(z / TEMPERATURE)
    p_t = jax.nn.softmax(teacher_hidden @ teacher_head / TEMPERATURE)
    np.testing.assert_allclose(z_grad(z), (p_s - p_t) / TEMPERATURE, rtol=1e-4, atol=1e-6)


def test_another_vocabulary_or_kind_is_one_error_naming_the_field():
    hidden, head, teacher_hidden, teacher_head = _problem()
    with pytest.raises(ValueError, match="distill_loss: the teacher's head has 12 outputs"):
        teacher_divergence(hidden, head, teacher_hidden, jnp.zeros((3, 12)), kind="forward_kl")
    with pytest.raises(ValueError, match="distill_loss: 'jsd' is not a divergence"):
        teacher_divergence(hidden, head, teacher_hidden, teacher_head, kind="jsd")
