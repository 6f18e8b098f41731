"""Drawing a token: the argmax and the two-level inverse-CDF categorical draw."""

import jax
import jax.numpy as jnp
import numpy as np

from jaxrl_agentic.sampling.draws import argmax_last, categorical


def test_argmax_last_takes_the_first_of_ties():
    x = np.random.default_rng(0).integers(0, 5, (64, 37)).astype(np.float32)
    x[0] = -np.inf
    x[1, [3, 30]] = 9.0
    x[2, [5, 9]] = np.nan
    np.testing.assert_array_equal(argmax_last(jnp.asarray(x)), np.argmax(x, axis=-1))


def test_categorical_matches_softmax_across_blocks():
    """The two-level inverse-CDF draw against exact softmax probabilities (chi-square),
    on a vocabulary that is not a multiple of the block (zero-padded last block) and with
    −inf entries (filtered tokens) that must never be drawn."""
    vocab, n = 50, 40000
    z = np.random.default_rng(1).normal(0.0, 1.5, vocab).astype(np.float32)
    z[[0, 7, 8, 31, 49]] = -np.inf  # block edges and the last token
    z[48] = 4.0  # a heavy token in the padded last block
    u = jax.random.uniform(jax.random.PRNGKey(5), (n, 2))
    tokens = np.asarray(jax.jit(categorical)(jnp.broadcast_to(jnp.asarray(z), (n, vocab)), u))
    counts = np.bincount(tokens, minlength=vocab)
    assert counts.size == vocab, "drew a padding index"
    p = np.exp(z - z.max()) / np.exp(z - z.max()).sum()
    assert counts[p == 0].sum() == 0, "drew a −inf token"
    cells = p * n >= 5
    chi2 = (((counts[cells] - n * p[cells]) ** 2) / (n * p[cells])).sum()
    dof = cells.sum() - 1
    assert chi2 < dof + 6 * np.sqrt(2 * dof), (chi2, dof)
    # A row with one finite logit always draws it.
    one = np.full((4, vocab), -np.inf, np.float32)
    one[:, 37] = 0.0
    np.testing.assert_array_equal(categorical(jnp.asarray(one), u[:4]), [37] * 4)


def test_categorical_never_lands_on_zero_mass_at_the_ends():
    """u = 0 and u → 1 hit the first and last cumulative sums exactly: the draw must still
    skip zero-probability tokens before and after the mass (and the block padding)."""
    vocab = 20  # blocks of 8: [0, 8), [8, 16), [16, 20) + 4 padding slots
    z = np.full((4, vocab), -np.inf, np.float32)
    z[:, [9, 12]] = 0.0  # all the mass inside the middle block, split in two
    below_one = np.nextafter(np.float32(1), np.float32(0))
    u = np.array([[0, 0], [0, below_one], [below_one, 0], [below_one, below_one]],
                 np.float32)
    np.testing.assert_array_equal(categorical(jnp.asarray(z), jnp.asarray(u)), [9, 12, 9, 12])
