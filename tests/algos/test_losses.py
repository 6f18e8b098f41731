"""Policy and value losses on hand-computed examples.

The policy example uses an identity lm head, so each hidden row *is* a row of logits and
the logprobs / entropies are plain numpy; old logprobs are then chosen to produce the
importance ratios of the table below, whose PPO terms are worked out by hand.
"""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxrl_agentic.algos.losses import (
    clipped_value_loss,
    entropy_bonus,
    flat_segment_ids,
    policy_loss,
    ppo_loss_impl,
    value_loss,
)
from jaxrl_agentic.algos.policy_losses import policy_loss_names
from jaxrl_agentic.algos.reductions import REDUCTIONS, loss_denominator, loss_weights

# ratio r, advantage A → PPO term with ε = 0.2, and with dual clip c = 3 (where it differs).
#   0: r=1.5 A=+1: max(-1.5, -1.2) = -1.2          clipped
#   1: r=1.5 A=-1: max( 1.5,  1.2) =  1.5
#   2: r=0.5 A=+1: max(-0.5, -0.8) = -0.5
#   3: r=4.0 A=-1: max( 4.0,  1.2) =  4.0 → dual: min(4, 3) = 3
#   4: r=1.0 A=+2: -2
#   5: r=0.7 A=-1: max( 0.7,  0.8) =  0.8          clipped
#   6: r=0.1 A=+1: max(-0.1, -0.8) = -0.1          (−A·c = −3 must NOT apply: A > 0)
#   7: masked (weight 0), garbage inputs
RATIOS = np.array([1.5, 1.5, 0.5, 4.0, 1.0, 0.7, 0.1, 1.0])
ADVANTAGES = np.array([1.0, -1.0, 1.0, -1.0, 2.0, -1.0, 1.0, np.inf])
WEIGHTS = np.array([1, 1, 1, 1, 1, 1, 1, 0], np.float32)
PG_NO_DUAL = -1.2 + 1.5 - 0.5 + 4.0 - 2.0 + 0.8 - 0.1  # 2.5
PG_DUAL = PG_NO_DUAL - 1.0  # token 3: 4 → 3


def _example(seed=0):
    rng = np.random.default_rng(seed)
    logits = rng.normal(size=(8, 4)).astype(np.float32)
    targets = rng.integers(0, 4, 8).astype(np.int32)
    log_p = logits - np.log(np.exp(logits).sum(-1, keepdims=True))
    logp = log_p[np.arange(8), targets]
    entropy = -(np.exp(log_p) * log_p).sum(-1)
    old = (logp - np.log(RATIOS)).astype(np.float32)
    return logits, targets, logp, entropy, old


def _loss(logits, targets, old, **kw):
    kw.setdefault("impl", "reference")
    return policy_loss(
        jnp.asarray(logits),
        jnp.eye(4, dtype=jnp.float32),
        jnp.asarray(targets),
        jnp.asarray(old),
        jnp.asarray(ADVANTAGES, jnp.float32),
        jnp.asarray(WEIGHTS),
        kw.pop("ref", None),
        **kw,
    )


def test_ppo_terms_by_hand():
    logits, targets, _, _, old = _example()
    plain = _loss(logits, targets, old, clip_low=0.2)
    assert float(plain.pg_loss) == pytest.approx(PG_NO_DUAL, abs=1e-5)
    assert float(plain.clipfrac) == 2  # tokens 0 and 5
    assert float(plain.tokens) == 7
    assert float(plain.ratio) == pytest.approx(RATIOS[:7].sum(), rel=1e-5)
    assert float(plain.approx_kl) == pytest.approx(-np.log(RATIOS[:7]).sum(), abs=1e-5)
    dual = _loss(logits, targets, old, clip_low=0.2, dual_clip=3.0)
    assert float(dual.pg_loss) == pytest.approx(PG_DUAL, abs=1e-5)
    assert float(dual.dual_clipfrac) == 1  # token 3 only; token 6 (A > 0) is untouched
    # Asymmetric clip: token 0 is clipped at 1 + 0.28 instead of 1.2.
    high = _loss(logits, targets, old, clip_low=0.2, clip_high=0.28)
    assert float(high.pg_loss) == pytest.approx(PG_NO_DUAL - 0.08, abs=1e-5)


def test_dual_clip_only_touches_negative_advantages():
    logits, targets, _, _, old = _example()
    for i in range(7):
        w = np.zeros(8, np.float32)
        w[i] = 1.0
        kw = dict(clip_low=0.2, impl="reference")
        args = (jnp.asarray(logits), jnp.eye(4), jnp.asarray(targets), jnp.asarray(old),
                jnp.asarray(ADVANTAGES, jnp.float32), jnp.asarray(w))
        without = float(policy_loss(*args, **kw).pg_loss)
        with_dual = float(policy_loss(*args, dual_clip=3.0, **kw).pg_loss)
        if ADVANTAGES[i] > 0:
            assert with_dual == without
        else:
            assert with_dual == pytest.approx(min(without, -ADVANTAGES[i] * 3.0), abs=1e-6)


def test_objective_combines_pg_kl_and_entropy():
    logits, targets, logp, entropy, old = _example()
    x = np.array([0.1, -0.2, 0.3, 0.0, 1.0, -1.0, 0.5, 0.0], np.float32)
    ref = jnp.asarray(logp - x)
    out = _loss(logits, targets, old, clip_low=0.2, ref=ref, kl_coef=0.5, kl_estimator="k3",
                entropy_coef=0.01)
    kl = float(np.sum(WEIGHTS * (np.exp(-x) + x - 1)))
    ent = float(np.sum(WEIGHTS * entropy))
    assert float(out.kl) == pytest.approx(kl, rel=1e-5)
    assert float(out.entropy) == pytest.approx(ent, rel=1e-5)
    assert float(out.objective) == pytest.approx(PG_NO_DUAL + 0.5 * kl - 0.01 * ent, abs=1e-5)
    assert float(entropy_bonus(jnp.asarray(entropy), jnp.asarray(WEIGHTS))) == pytest.approx(
        ent, rel=1e-6
    )


def test_objective_gradient_matches_full_logits_autodiff():
    logits, targets, logp, _, old = _example(3)
    ref = jnp.asarray(logp - 0.3)
    kw = dict(clip_low=0.2, clip_high=0.3, dual_clip=3.0, kl_coef=0.2, entropy_coef=0.05)

    def fused(h):
        return _loss(h, targets, old, ref=ref, impl="auto", **kw).objective

    def straightforward(h):
        log_p = jax.nn.log_softmax(h, axis=-1)
        lp = log_p[jnp.arange(8), targets]
        r = jnp.exp(lp - old)
        a = jnp.asarray(np.where(WEIGHTS > 0, ADVANTAGES, 0.0), jnp.float32)
        pg = jnp.maximum(-a * r, -a * jnp.clip(r, 0.8, 1.3))
        pg = jnp.where(a < 0, jnp.minimum(pg, -a * 3.0), pg)
        xk = lp - ref
        kl = jnp.exp(-xk) + xk - 1
        ent = -(jnp.exp(log_p) * log_p).sum(-1)
        return jnp.sum(WEIGHTS * (pg + 0.2 * kl - 0.05 * ent))

    h = jnp.asarray(logits)
    assert float(fused(h)) == pytest.approx(float(straightforward(h)), abs=1e-5)
    np.testing.assert_allclose(jax.grad(fused)(h), jax.grad(straightforward)(h), atol=1e-6)


def test_value_loss_clipping_by_hand():
    #         V    V_old  R    unclipped  clip(V)  clipped   ½·max
    # a:     1.0   0.5   0.0   1.0        0.7      0.49      0.5
    # b:     0.0   0.5   1.0   1.0        0.3      0.49      0.5
    # c:     0.8   0.5   1.0   0.04       0.7      0.09      0.045  (clipping raises the loss)
    # d:     0.6   0.5   2.0   1.96       0.6      1.96      0.98   (inside the band)
    v = jnp.array([1.0, 0.0, 0.8, 0.6])
    v_old = jnp.array([0.5, 0.5, 0.5, 0.5])
    ret = jnp.array([0.0, 1.0, 1.0, 2.0])
    np.testing.assert_allclose(
        clipped_value_loss(v, v_old, ret, 0.2), [0.5, 0.5, 0.045, 0.98], rtol=1e-5
    )
    np.testing.assert_allclose(
        clipped_value_loss(v, v_old, ret, None), [0.5, 0.5, 0.02, 0.98], rtol=1e-5
    )
    mask, seg = jnp.array([1.0, 1.0, 1.0, 0.0]), jnp.array([1, 1, 2, 2])
    total, denom = value_loss(v, v_old, ret, mask, seg, "token_mean", clip_eps=0.2)
    assert (float(total), float(denom)) == pytest.approx((1.045, 3.0))
    total, denom = value_loss(v, v_old, ret, mask, seg, "seq_mean_token_mean", clip_eps=0.2)
    assert (float(total), float(denom)) == pytest.approx((0.5 + 0.045, 2.0))
    # Gradient flows through V only; clipped-branch tokens (a, b: unclipped wins) keep it.
    g = jax.grad(lambda x: value_loss(x, v_old, ret, mask, seg, clip_eps=0.2)[0])(v)
    np.testing.assert_allclose(g, [1.0, -1.0, 0.0, 0.0], atol=1e-6)


def test_kernel_impl_pairing():
    assert ppo_loss_impl("chunked") == "reference"
    assert ppo_loss_impl("pallas") == "pallas"
    with pytest.raises(ValueError, match="kernel_impl"):
        ppo_loss_impl("triton")


# ----------------------------------------------------------------------------- variants × packing

VOCAB = 5
SAMPLE_LENGTHS = (6, 3, 5, 2, 4)


def _variant_samples(seed=0):
    """Per-sample (logits, targets, old, advantages, mask); old chosen so ratios get clipped."""
    rng = np.random.default_rng(seed)
    out = []
    for i, n in enumerate(SAMPLE_LENGTHS):
        logits = rng.normal(size=(n, VOCAB)).astype(np.float32)
        targets = rng.integers(0, VOCAB, n).astype(np.int32)
        log_p = logits - np.log(np.exp(logits).sum(-1, keepdims=True))
        logp = log_p[np.arange(n), targets]
        old = (logp + rng.normal(size=n) * 0.4).astype(np.float32)
        adv = np.full(n, rng.normal() * 2, np.float32)  # one scalar per sample, as in GRPO
        mask = np.ones(n, np.float32)
        mask[: 1 + i % 2] = 0.0  # a prompt token or two
        out.append((logits, targets, old, adv, mask))
    return out


def _layout(rows, width):
    """[B, T] (sample, position) grids from rows given as lists of sample indices."""
    sample = np.full((len(rows), width), -1)
    pos = np.zeros((len(rows), width), int)
    seg = np.zeros((len(rows), width), np.int32)
    for r, members in enumerate(rows):
        col = 0
        for k, i in enumerate(members):
            n = SAMPLE_LENGTHS[i]
            sample[r, col:col + n], pos[r, col:col + n], seg[r, col:col + n] = i, range(n), k + 1
            col += n
    return sample, pos, seg


def _accumulated_loss(theta, samples, micro_batches, width, variant, reduction):
    """Σ_micro objective / Σ_micro D with each micro-batch a list of rows."""
    offsets = np.cumsum((0,) + SAMPLE_LENGTHS)
    total, denominator = 0.0, 0.0
    for rows in micro_batches:
        sample, pos, seg = _layout(rows, width)
        flat = np.where(sample >= 0, offsets[np.maximum(sample, 0)] + pos, -1).reshape(-1)
        pad = flat < 0

        def pick(k, fill, flat=flat, pad=pad):
            cat = np.concatenate([s[k] for s in samples])
            return jnp.asarray(np.where(pad, fill, cat[np.maximum(flat, 0)]))

        hidden = jnp.where(jnp.asarray(pad)[:, None], 0.0, theta[np.maximum(flat, 0)])
        mask = pick(4, 0.0).reshape(seg.shape)
        weights = loss_weights(mask, seg, reduction, loss_norm_length=8)
        sums = policy_loss(hidden, jnp.eye(VOCAB), pick(1, 0).astype(jnp.int32),
                           pick(2, np.nan), pick(3, np.nan), weights.reshape(-1),
                           clip_low=0.2, clip_high=0.28, policy_loss=variant,
                           segment_ids=seg, impl="reference")
        total = total + sums.objective
        denominator = denominator + loss_denominator(mask, seg, reduction)
    return total / jnp.maximum(denominator, 1.0)


@pytest.mark.parametrize("variant", policy_loss_names())
@pytest.mark.parametrize("reduction", REDUCTIONS)
def test_variants_are_exact_under_any_packing(variant, reduction):
    samples = _variant_samples()
    theta = jnp.asarray(np.concatenate([s[0] for s in samples]))
    layouts = {
        # all five samples in one row
        "one_row": ([[[0, 1, 2, 3, 4]]], 20),
        # sample 0 fills row 0 exactly, so row 1's first sample (id 1) follows it directly
        # in the flattened array: the per-sample mean must not merge them.
        "rows": ([[[0], [1, 3], [2], [4], []]], 6),
        # the same rows as four micro-batches (the empty row is its own, all padding)
        "micro": ([[[0]], [[1, 3], [2]], [[4]], [[]]], 6),
        "reordered": ([[[4, 2]], [[3, 0, 1]]], 14),
    }
    values, grads = {}, {}
    for name, (micro_batches, width) in layouts.items():
        fn = lambda t, m=micro_batches, w=width: _accumulated_loss(  # noqa: E731
            t, samples, m, w, variant, reduction)
        values[name], grads[name] = jax.value_and_grad(fn)(theta)
    assert np.all(np.isfinite(np.asarray(grads["one_row"])))
    assert float(jnp.max(jnp.abs(grads["one_row"]))) > 1e-3
    for name in layouts:
        np.testing.assert_allclose(values[name], values["one_row"], rtol=1e-5, err_msg=name)
        np.testing.assert_allclose(grads[name], grads["one_row"], rtol=1e-5, atol=1e-7,
                                   err_msg=name)


def test_flat_segment_ids_separate_rows():
    seg = jnp.array([[1, 1, 1], [1, 2, 0]])
    np.testing.assert_array_equal(flat_segment_ids(seg), [1, 1, 1, 5, 6, 0])
    np.testing.assert_array_equal(flat_segment_ids(seg[0]), [1, 1, 1])


def test_gspo_and_cispo_through_policy_loss_by_hand():
    # One sample, two loss tokens with ratios 1.5 and 0.5, A = +1, ε = 0.2 (see test_ppo_loss
    # for the kernel-level tables): GSPO's s = √0.75 is inside the band, PPO clips token 0.
    logits, targets, _, _, old = _example()
    w = np.zeros(8, np.float32)
    w[[0, 2]] = 1.0  # ratios 1.5 and 0.5, A = +1 on both
    seg = np.array([1, 1, 1, 2, 2, 2, 3, 3])
    args = (jnp.asarray(logits), jnp.eye(4), jnp.asarray(targets), jnp.asarray(old),
            jnp.asarray(ADVANTAGES, jnp.float32), jnp.asarray(w))
    ppo = policy_loss(*args, impl="reference")
    gspo = policy_loss(*args, policy_loss="gspo", segment_ids=jnp.asarray(seg))
    assert float(ppo.pg_loss) == pytest.approx(-1.2 - 0.5, abs=1e-5)
    assert float(gspo.pg_loss) == pytest.approx(-2 * np.sqrt(0.75), abs=1e-5)
    assert float(ppo.clipfrac_high) == 1 and float(gspo.clipfrac) == 0
    cispo = policy_loss(*args, policy_loss="cispo")
    assert float(cispo.clipfrac_high) == 1 and float(cispo.clipfrac_low) == 1


def test_policy_loss_with_top_k_uses_the_restricted_logprobs():
    # With old = the restricted logprob, every ratio is 1: pg = −Σ w·A exactly.
    from pallas_kernels import restricted_token_logprobs

    logits, targets, _, _, _ = _example()
    targets = np.argmax(logits, axis=-1).astype(np.int32)  # inside any top-2 set
    h, y = jnp.asarray(logits), jnp.asarray(targets)
    old = restricted_token_logprobs(h, jnp.eye(4), y, top_k=2)
    out = policy_loss(h, jnp.eye(4), y, old, jnp.asarray(ADVANTAGES, jnp.float32),
                      jnp.asarray(WEIGHTS), top_k=2, impl="reference")
    assert float(out.ratio) == pytest.approx(7.0, abs=1e-5)
    expected = -float(np.sum(WEIGHTS[:7] * ADVANTAGES[:7]))
    assert float(out.pg_loss) == pytest.approx(expected, abs=1e-5)
