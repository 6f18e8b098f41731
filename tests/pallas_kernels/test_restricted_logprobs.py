"""Top-k / top-p restricted logprobs: the sampler's support exactly, and the bias removed."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxrl_agentic.sampling.draws import filter_logits
from pallas_kernels import token_logprobs
from pallas_kernels.restricted_logprobs import (
    OUT_OF_SUPPORT_LOGPROB,
    restricted_token_logprobs,
    support_mask,
)

N, D, V, T = 19, 16, 50, 0.8
SETTINGS = [(5, 1.0), (0, 0.7), (8, 0.9), (1, 1.0), (0, 0.05)]


@pytest.mark.parametrize("top_k,top_p", SETTINGS + [(60, 1.0), (3, 0.5)])
def test_support_is_the_samplers(top_k, top_p):
    rng = np.random.default_rng(top_k)
    # Rounded logits make ties, including at the k-th value and at the top-p threshold.
    z = jnp.asarray(np.round(rng.normal(size=(64, V)) * 2) / 2, jnp.float32)
    sampler = filter_logits(z, jnp.int32(top_k), jnp.float32(top_p)) > -jnp.inf
    np.testing.assert_array_equal(support_mask(z, top_k, top_p), sampler)


def _data(seed=0):
    rng = np.random.default_rng(seed)
    h = jnp.asarray(rng.normal(size=(N, D)), jnp.float32)
    w = jnp.asarray(rng.normal(size=(D, V)) * 0.5, jnp.float32)
    return h, w


def _sampler_distribution(h, w, top_k, top_p):
    z = jnp.dot(h, w, precision="highest") / T
    filtered = filter_logits(z, jnp.int32(top_k), jnp.float32(top_p))
    return z, jax.nn.log_softmax(filtered, axis=-1)


@pytest.mark.parametrize("top_k,top_p", SETTINGS)
def test_restricted_logprob_is_the_sampling_distribution(top_k, top_p):
    h, w = _data()
    z, log_q = _sampler_distribution(h, w, top_k, top_p)
    # Targets drawn from the sampler's own distribution (so always inside its support).
    y = jax.random.categorical(jax.random.key(1), log_q)
    restricted = restricted_token_logprobs(h, w, y, T, top_k=top_k, top_p=top_p, block_n=4)
    expected = jnp.take_along_axis(log_q, y[:, None], axis=1)[:, 0]
    np.testing.assert_allclose(restricted, expected, rtol=1e-5, atol=1e-5)
    # The bias the restriction removes: unrestricted = restricted + log(kept mass).
    unrestricted = token_logprobs(h, w, y, T, impl="reference")
    kept = jnp.isfinite(log_q)
    log_mass = jnp.log(jnp.sum(jnp.where(kept, jax.nn.softmax(z, axis=-1), 0.0), axis=-1))
    np.testing.assert_allclose(unrestricted, restricted + log_mass, rtol=1e-5, atol=1e-5)
    if top_k or top_p < 1:
        assert float(jnp.max(-log_mass)) > 1e-2  # the bias is real in this example


def test_gradient_and_entropy_match_full_logits_autodiff():
    h, w = _data(2)
    top_k, top_p = 8, 0.9
    _, log_q = _sampler_distribution(h, w, top_k, top_p)
    y = jax.random.categorical(jax.random.key(3), log_q)
    g = jnp.asarray(np.random.default_rng(4).normal(size=(2, N)), jnp.float32)

    def fused(h, w):
        lp, ent = restricted_token_logprobs(h, w, y, T, top_k=top_k, top_p=top_p,
                                            return_entropy=True, block_n=8)
        return jnp.sum(g[0] * lp + g[1] * ent)

    def direct(h, w):
        z = jnp.dot(h, w, precision="highest") / T
        keep = jax.lax.stop_gradient(
            filter_logits(jax.lax.stop_gradient(z), jnp.int32(top_k), jnp.float32(top_p))
            > -jnp.inf)
        lq = jax.nn.log_softmax(jnp.where(keep, z, -1e30), axis=-1)
        ent = -jnp.sum(jnp.where(keep, jnp.exp(lq) * lq, 0.0), axis=-1)
        return jnp.sum(g[0] * jnp.take_along_axis(lq, y[:, None], axis=1)[:, 0] + g[1] * ent)

    np.testing.assert_allclose(fused(h, w), direct(h, w), rtol=1e-5)
    for a, b in zip(jax.grad(fused, (0, 1))(h, w), jax.grad(direct, (0, 1))(h, w),
                    strict=True):
        np.testing.assert_allclose(a, b, rtol=1e-4, atol=1e-6)


def test_out_of_support_target_is_finite_with_zero_gradient():
    h, w = _data(5)
    z = jnp.dot(h, w, precision="highest") / T
    y = jnp.argmin(z, axis=-1)  # the least likely token: outside any top-5 set
    fn = lambda h: restricted_token_logprobs(h, w, y, T, top_k=5)  # noqa: E731
    np.testing.assert_array_equal(fn(h), np.full(N, OUT_OF_SUPPORT_LOGPROB, np.float32))
    grad = jax.grad(lambda h: jnp.sum(fn(h)))(h)
    assert np.all(np.asarray(grad) == 0.0)


def test_no_restriction_equals_token_logprobs():
    h, w = _data(6)
    y = jnp.asarray(np.random.default_rng(6).integers(0, V, N), jnp.int32)
    lp, ent = restricted_token_logprobs(h, w, y, T, return_entropy=True, block_n=5)
    ref_lp, ref_ent = token_logprobs(h, w, y, T, impl="reference", return_entropy=True)
    np.testing.assert_allclose(lp, ref_lp, rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(ent, ref_ent, rtol=1e-5, atol=1e-6)
