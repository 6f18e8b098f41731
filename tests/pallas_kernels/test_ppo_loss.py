"""Masked PPO loss sums: hand-computed values, reductions, masking, kernel vs reference."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from pallas_kernels import PPOLossSums, masked_ppo_loss

IMPLS = ["reference", "pallas"]


def _loss_and_grad(impl, old, adv, w, ref=None, kl_coef=1.0, **kw):
    def loss(lp):
        sums = masked_ppo_loss(lp, old, adv, w, ref, impl=impl, **kw)
        return sums.pg_loss + kl_coef * sums.kl, sums

    return jax.jit(jax.value_and_grad(loss, has_aux=True))


def _hand_example():
    """4 weighted tokens with ratios 1.5, 0.5, 1.1, 4 (ε = 0.2) + 2 masked garbage tokens."""
    ratio = np.array([1.5, 0.5, 1.1, 4.0])
    old = np.concatenate([-np.log(ratio), [-np.inf, np.nan]])
    logp = np.array([0.0, 0.0, 0.0, 0.0, 50.0, 0.0])
    adv = np.array([1.0, -1.0, 2.0, -2.0, np.nan, 1e30])
    w = np.array([1.0, 1.0, 1.0, 1.0, 0.0, 0.0])
    return [jnp.asarray(x, jnp.float32) for x in (logp, old, adv, w)]


@pytest.mark.parametrize("impl", IMPLS)
def test_hand_computed_without_dual_clip(impl):
    logp, old, adv, w = _hand_example()
    # Per token: max(−A·r, −A·clip(r, 0.8, 1.2)):
    #   r=1.5, A=1:  max(−1.5, −1.2) = −1.2  clipped      grad 0
    #   r=0.5, A=−1: max(0.5, 0.8)   = 0.8   clipped      grad 0
    #   r=1.1, A=2:  max(−2.2, −2.2) = −2.2               grad −A·r = −2.2
    #   r=4,   A=−2: max(8, 2.4)     = 8                  grad −A·r = 8
    (value, sums), grad = _loss_and_grad(impl, old, adv, w)(logp)
    np.testing.assert_allclose(value, 5.4, rtol=1e-6)
    np.testing.assert_allclose(sums.pg_loss, 5.4, rtol=1e-6)
    assert float(sums.kl) == 0.0
    assert float(sums.clipfrac) == 2.0 and float(sums.dual_clipfrac) == 0.0
    np.testing.assert_allclose(sums.ratio, 7.1, rtol=1e-6)
    np.testing.assert_allclose(sums.approx_kl, -np.log(1.5 * 0.5 * 1.1 * 4.0), rtol=1e-6)
    np.testing.assert_allclose(grad, [0.0, 0.0, -2.2, 8.0, 0.0, 0.0], atol=1e-6)


@pytest.mark.parametrize("impl", IMPLS)
def test_hand_computed_dual_clip(impl):
    logp, old, adv, w = _hand_example()
    # Dual clip c = 3 for A < 0: token 4 becomes min(8, 2·3) = 6 with zero gradient;
    # token 2 (0.8 < 1·3) is untouched.
    (_, sums), grad = _loss_and_grad(impl, old, adv, w, dual_clip=3.0)(logp)
    np.testing.assert_allclose(sums.pg_loss, 3.4, rtol=1e-6)
    assert float(sums.clipfrac) == 2.0 and float(sums.dual_clipfrac) == 1.0
    np.testing.assert_allclose(grad, [0.0, 0.0, -2.2, 0.0, 0.0, 0.0], atol=1e-6)


@pytest.mark.parametrize("impl", IMPLS)
def test_dual_clip_leaves_positive_advantages_alone(impl):
    ratio = np.array([5.0, 5.0, 0.1, 0.1])
    old = jnp.asarray(-np.log(ratio), jnp.float32)
    logp = jnp.zeros(4)
    adv = jnp.asarray([2.0, -2.0, 2.0, -2.0])
    w = jnp.ones(4)
    plain = masked_ppo_loss(logp, old, adv, w, impl=impl)
    dual = masked_ppo_loss(logp, old, adv, w, impl=impl, dual_clip=3.0)
    # Per token without dual: max(−10, −2.4), max(10, 2.4), max(−0.2, −1.6), max(0.2, 1.6).
    np.testing.assert_allclose(plain.pg_loss, -2.4 + 10.0 - 0.2 + 1.6, rtol=1e-6)
    # Only the A < 0 token with 10 > 2·3 changes (to 6); A > 0 tokens keep their values.
    np.testing.assert_allclose(dual.pg_loss, -2.4 + 6.0 - 0.2 + 1.6, rtol=1e-6)
    assert float(dual.dual_clipfrac) == 1.0
    # clip_high differs from clip_low: r = 5, A = 2 → −2·(1 + 0.28).
    asym = masked_ppo_loss(logp[:1], old[:1], adv[:1], w[:1], impl=impl, clip_high=0.28)
    np.testing.assert_allclose(asym.pg_loss, -2.56, rtol=1e-6)


@pytest.mark.parametrize("impl", IMPLS)
@pytest.mark.parametrize("estimator,value,grad", [
    ("k1", 0.0, [1.0, 1.0]),
    ("k2", 0.25, [0.5, -0.5]),
    # exp(−x) + x − 1 summed over x = ±0.5; gradient 1 − exp(−x).
    ("k3", np.exp(-0.5) + np.exp(0.5) - 2.0, [1 - np.exp(-0.5), 1 - np.exp(0.5)]),
])
def test_kl_estimators(impl, estimator, value, grad):
    logp = jnp.asarray([0.5, -0.5])
    ref = jnp.zeros(2)
    zeros, w = jnp.zeros(2), jnp.ones(2)
    # old = logp and A = 0: the policy term is 0, only the KL term drives the gradient.
    fn = _loss_and_grad(impl, logp, zeros, w, ref, kl_estimator=estimator)
    (_, sums), g = fn(logp)
    np.testing.assert_allclose(sums.kl, value, rtol=1e-6, atol=1e-7)
    assert float(sums.pg_loss) == 0.0
    np.testing.assert_allclose(g, grad, rtol=1e-6, atol=1e-7)


def _packed_batch():
    """3 rows × 8: segment 2 has no loss tokens, row 2 is all padding."""
    seg = np.array([[1, 1, 1, 2, 2, 2, 2, 0],
                    [3, 3, 3, 3, 4, 4, 0, 0],
                    [0, 0, 0, 0, 0, 0, 0, 0]])
    mask = np.array([[0, 1, 1, 0, 0, 0, 0, 0],
                     [0, 1, 1, 1, 1, 1, 0, 0],
                     [0, 0, 0, 0, 0, 0, 0, 0]], dtype=np.float64)
    rng = np.random.default_rng(3)
    logp = rng.normal(size=seg.shape) * 0.5 - 1.0
    old = logp + rng.normal(size=seg.shape) * 0.4
    adv = rng.normal(size=seg.shape) * 2.0
    # Garbage where nothing is learned: must not leak into sums or gradients.
    old[mask == 0] = np.inf
    adv[2] = np.nan
    return seg, mask, logp, old, adv


def _pg_tokens_numpy(logp, old, adv, eps=0.2):
    ratio = np.exp(logp - old)
    return np.maximum(-adv * ratio, -adv * np.clip(ratio, 1 - eps, 1 + eps))


def _reduction_weights(seg, mask, reduction):
    if reduction == "token_mean":
        return mask.copy(), mask.sum()
    weights = np.zeros_like(mask)
    n_segments = 0
    for s in np.unique(seg[seg > 0]):
        in_seg = seg == s
        count = mask[in_seg].sum()
        if count:
            weights[in_seg] = mask[in_seg] / count
            n_segments += 1
    return weights, n_segments


@pytest.mark.parametrize("impl", IMPLS)
@pytest.mark.parametrize("reduction", ["token_mean", "seq_mean_token_mean"])
def test_reduction_weights(impl, reduction):
    seg, mask, logp, old, adv = _packed_batch()
    weights, denominator = _reduction_weights(seg, mask, reduction)
    pg_tok = _pg_tokens_numpy(logp, old, adv)
    if reduction == "token_mean":
        expected = pg_tok[mask > 0].mean()
    else:
        expected = np.mean([pg_tok[(seg == s) & (mask > 0)].mean() for s in (1, 3, 4)])

    flat = [jnp.asarray(x.reshape(-1), jnp.float32) for x in (logp, old, adv, weights)]
    sums = masked_ppo_loss(*flat, impl=impl)
    np.testing.assert_allclose(float(sums.pg_loss) / denominator, expected, rtol=1e-5)
    assert float(sums.ratio) == pytest.approx(np.exp(logp - old)[mask > 0].sum(), rel=1e-5)


@pytest.mark.parametrize("reduction", ["token_mean", "seq_mean_token_mean"])
def test_kernel_gradient_per_reduction(reduction):
    seg, mask, logp, old, adv = _packed_batch()
    weights, _ = _reduction_weights(seg, mask, reduction)
    ref = logp + 0.3
    lp, old, adv, w, ref = [jnp.asarray(x.reshape(-1), jnp.float32)
                            for x in (logp, old, adv, weights, ref)]
    results = [_loss_and_grad(impl, old, adv, w, ref, kl_coef=0.1)(lp) for impl in IMPLS]
    ((v_ref, s_ref), g_ref), ((v_k, s_k), g_k) = results
    np.testing.assert_allclose(v_k, v_ref, rtol=1e-5)
    np.testing.assert_allclose(g_k, g_ref, rtol=1e-5, atol=1e-7)
    assert np.all(np.asarray(g_ref)[mask.reshape(-1) == 0] == 0.0)


@pytest.mark.parametrize("impl", IMPLS)
def test_all_masked_is_exactly_zero(impl):
    n = 40
    logp = jnp.full((n,), 80.0)
    old = jnp.full((n,), -jnp.inf)
    ref = jnp.full((n,), jnp.nan)
    adv = jnp.full((n,), jnp.nan)
    w = jnp.zeros(n)
    (value, sums), grad = _loss_and_grad(impl, old, adv, w, ref, dual_clip=3.0)(logp)
    assert float(value) == 0.0
    assert all(float(x) == 0.0 for x in sums)
    assert np.all(np.asarray(grad) == 0.0)


@pytest.mark.parametrize("estimator,dual,with_ref", [
    ("k3", 3.0, True), ("k1", None, True), ("k2", 3.0, True), ("k3", None, False),
])
def test_kernel_matches_reference_random(estimator, dual, with_ref):
    # 2500 tokens with block_rows = 8 (1024 tokens per block): 3 blocks, the last ragged.
    n = 2500
    rng = np.random.default_rng(7)
    logp = rng.normal(size=n) * 0.5 - 1.0
    cols = dict(
        old=logp + rng.normal(size=n) * 0.6,  # ratios far outside [0.8, 1.28]: clips happen
        adv=rng.normal(size=n) * 2.0,
        w=(rng.uniform(size=n) > 0.3) * rng.uniform(0.1, 1.0, size=n),
        ref=logp + rng.normal(size=n) * 0.3,
    )
    lp = jnp.asarray(logp, jnp.float32)
    c = {k: jnp.asarray(v, jnp.float32) for k, v in cols.items()}
    ref = c["ref"] if with_ref else None
    kw = dict(clip_high=0.28, dual_clip=dual, kl_estimator=estimator, kl_coef=0.1)
    (v_ref, s_ref), g_ref = _loss_and_grad("reference", c["old"], c["adv"], c["w"], ref,
                                           **kw)(lp)
    (v_k, s_k), g_k = _loss_and_grad("pallas", c["old"], c["adv"], c["w"], ref,
                                     block_rows=8, **kw)(lp)
    assert s_ref.clipfrac > 0 and (dual is None or s_ref.dual_clipfrac > 0)
    for name in PPOLossSums._fields:
        np.testing.assert_allclose(getattr(s_k, name), getattr(s_ref, name), rtol=1e-5,
                                   atol=1e-4, err_msg=name)
    np.testing.assert_allclose(v_k, v_ref, rtol=1e-5, atol=1e-4)
    np.testing.assert_allclose(g_k, g_ref, rtol=1e-5, atol=1e-7)


@pytest.mark.parametrize("impl", IMPLS)
def test_diagnostics_carry_no_gradient(impl):
    lp = jnp.asarray([0.1, -0.3, 0.2])
    old, adv, w = jnp.zeros(3), jnp.asarray([1.0, -1.0, 0.5]), jnp.ones(3)

    def diagnostics(lp):
        s = masked_ppo_loss(lp, old, adv, w, impl=impl, dual_clip=3.0)
        return s.clipfrac + s.dual_clipfrac + s.ratio + s.approx_kl

    assert np.all(np.asarray(jax.grad(diagnostics)(lp)) == 0.0)


def test_rejects_bad_arguments():
    x = jnp.zeros(4)
    with pytest.raises(ValueError, match="kl_estimator"):
        masked_ppo_loss(x, x, x, x, x, kl_estimator="k4")
    with pytest.raises(ValueError, match="dual_clip"):
        masked_ppo_loss(x, x, x, x, dual_clip=0.5)
    with pytest.raises(ValueError, match="shape"):
        masked_ppo_loss(x, x[:3], x, x)
    with pytest.raises(ValueError, match="impl"):
        masked_ppo_loss(x, x, x, x, impl="chunked")
    with pytest.raises(ValueError, match="block_rows"):
        masked_ppo_loss(x, x, x, x, impl="pallas", block_rows=12)


# ----------------------------------------------------------------------------- variants


@pytest.mark.parametrize("impl", IMPLS)
def test_clip_low_and_high_split_clipped(impl):
    logp, old, adv, w = _hand_example()
    # From the hand example: r=1.5, A=+1 is capped from above; r=0.5, A=−1 from below.
    sums = masked_ppo_loss(logp, old, adv, w, impl=impl)
    assert float(sums.clipfrac_high) == 1.0 and float(sums.clipfrac_low) == 1.0
    assert float(sums.clipfrac) == float(sums.clipfrac_low + sums.clipfrac_high)


@pytest.mark.parametrize("impl", IMPLS)
def test_cispo_keeps_the_tokens_ppo_clips(impl):
    logp, old, adv, w = _hand_example()
    # −sg(clip(r, 0.8, 1.2))·A·logp with gradient −clip(r)·A on every weighted token:
    #   r=1.5, A=1:  weight 1.2  grad −1.2   (PPO: clipped, grad 0)
    #   r=0.5, A=−1: weight 0.8  grad  0.8   (PPO: clipped, grad 0)
    #   r=1.1, A=2:  weight 1.1  grad −2.2   (= PPO)
    #   r=4,   A=−2: weight 1.2  grad  2.4   (PPO: −A·r = 8)
    logp = logp.at[:4].set(jnp.asarray([-0.5, -1.0, -2.0, -0.25]))
    old = old.at[:4].set(logp[:4] - jnp.log(jnp.asarray([1.5, 0.5, 1.1, 4.0])))
    (_, sums), grad = _loss_and_grad(impl, old, adv, w, surrogate="weight")(logp)
    np.testing.assert_allclose(grad, [-1.2, 0.8, -2.2, 2.4, 0.0, 0.0], rtol=1e-5, atol=1e-6)
    expected_pg = -1.2 * -0.5 + 0.8 * -1.0 - 2.2 * -2.0 + 2.4 * -0.25
    np.testing.assert_allclose(sums.pg_loss, expected_pg, rtol=1e-5)
    # Weight truncated on 3 tokens: r=0.5 from below, r=1.5 and r=4 from above.
    assert (float(sums.clipfrac), float(sums.clipfrac_low), float(sums.clipfrac_high)) == (3, 1, 2)
    (_, _), ppo_grad = _loss_and_grad(impl, old, adv, w)(logp)
    np.testing.assert_allclose(ppo_grad[:2], [0.0, 0.0], atol=1e-7)


def _gspo_example():
    """Three samples in one row (ε = 0.2), each with A = ±1 on all its loss tokens:

    seg 1: d = log 1.5, log 0.5 (+ a masked garbage token), A = +1
    seg 2: d = log 2, log 2, A = −1
    seg 3: d = log 1.5, log 1.5, A = +1
    then 2 padding tokens.
    """
    d = np.log([1.5, 1.0, 0.5, 2.0, 2.0, 1.5, 1.5, 1.0, 1.0])
    logp = np.array([-1.0, 9.0, -2.0, -0.5, -0.7, -1.5, -0.2, 0.0, 0.0])
    old = logp - d
    old[1] = np.nan
    adv = np.array([1.0, np.inf, 1.0, -1.0, -1.0, 1.0, 1.0, 0.0, 0.0])
    w = np.array([1.0, 0.0, 1.0, 1.0, 1.0, 1.0, 1.0, 0.0, 0.0])
    seg = np.array([1, 1, 1, 2, 2, 3, 3, 0, 0])
    return [jnp.asarray(x, jnp.float32) for x in (logp, old, adv, w)] + [jnp.asarray(seg)]


@pytest.mark.parametrize("impl", IMPLS)  # "pallas" falls back to the reference for gspo
def test_gspo_sequence_ratio_by_hand(impl):
    logp, old, adv, w, seg = _gspo_example()
    s1 = np.sqrt(1.5 * 0.5)  # exp(mean(log 1.5, log 0.5)) = 0.866, inside [0.8, 1.2]
    # seg 1: −A·s1 on each of 2 tokens; grad of Σ_u −A·s1 w.r.t. each logp_t = −s1·2/2.
    # seg 2: s = 2, A = −1: max(2, 1.2) = 2 per token → 4; grad = +2·2/2 = 2 per token.
    # seg 3: s = 1.5, A = +1: clipped at 1.2 → −1.2 per token, grad 0.
    (_, sums), grad = _loss_and_grad(impl, old, adv, w, sequence_ratio=True,
                                     segment_ids=seg)(logp)
    np.testing.assert_allclose(sums.pg_loss, -2 * s1 + 4.0 - 2.4, rtol=1e-5)
    np.testing.assert_allclose(grad, [-s1, 0, -s1, 2, 2, 0, 0, 0, 0], rtol=1e-5, atol=1e-6)
    assert (float(sums.clipfrac), float(sums.clipfrac_low), float(sums.clipfrac_high)) == (2, 0, 2)
    np.testing.assert_allclose(sums.ratio, 2 * s1 + 4.0 + 3.0, rtol=1e-5)
    # approx_kl_old stays token level: Σ (old − logp) over the 6 loss tokens.
    np.testing.assert_allclose(sums.approx_kl, -np.log(1.5 * 0.5 * 4 * 2.25), rtol=1e-5)
    # Token-level PPO on the same data differs: seg 1 token 0 (r = 1.5) is clipped there.
    ppo = masked_ppo_loss(logp, old, adv, w, impl=impl)
    np.testing.assert_allclose(ppo.pg_loss, -1.2 - 0.5 + 4.0 - 2.4, rtol=1e-5)
    assert abs(float(ppo.pg_loss) - float(sums.pg_loss)) > 0.03


@pytest.mark.parametrize("impl", IMPLS)
def test_gspo_token_form_keeps_each_tokens_own_advantage(impl):
    # One on-policy 4-token sample with per-turn advantages [1, 1, −1, −1] and
    # seq-mean-token-mean weights 1/4: s_i = 1, nothing is clipped, so the GSPO-token
    # gradient is −w_u·A_u·s_i = [−.25, −.25, .25, .25]. The sequence form (−A·∇s_i spread
    # over the sample) would give Σ_t w_t·A_t·(1/4) = 0 on every token.
    logp = jnp.asarray([-0.5, -1.0, -1.5, -2.0])
    adv = jnp.asarray([1.0, 1.0, -1.0, -1.0])
    w, seg = jnp.full(4, 0.25), jnp.ones(4, jnp.int32)
    (_, sums), grad = _loss_and_grad(impl, logp, adv, w, sequence_ratio=True,
                                     segment_ids=seg)(logp)
    np.testing.assert_allclose(grad, [-0.25, -0.25, 0.25, 0.25], atol=1e-7)
    np.testing.assert_allclose(sums.pg_loss, 0.0, atol=1e-7)
    np.testing.assert_allclose(sums.ratio, 4.0, rtol=1e-6)


def test_gspo_token_form_clips_per_token():
    # s_i = 1.5 (outside [0.8, 1.2]) on a 2-token sample with A = [+1, −1]: the A > 0 token
    # takes the clipped branch (no gradient); the A < 0 token keeps −A·s_i = 1.5.
    logp = jnp.asarray([0.0, 0.0])
    old = jnp.full(2, -np.log(1.5), jnp.float32)
    adv, w, seg = jnp.asarray([1.0, -1.0]), jnp.ones(2), jnp.asarray([1, 1])
    (_, sums), grad = _loss_and_grad("reference", old, adv, w, sequence_ratio=True,
                                     segment_ids=seg)(logp)
    np.testing.assert_allclose(grad, [0.0, 1.5], rtol=1e-6)
    np.testing.assert_allclose(sums.pg_loss, -1.2 + 1.5, rtol=1e-6)
    assert (float(sums.clipfrac_high), float(sums.clipfrac_low)) == (1.0, 0.0)


def test_gspo_single_token_samples_equal_ppo():
    # With one loss token per sample the sequence ratio is the token ratio.
    seg, mask, logp, old, adv = _packed_batch()
    ids = np.arange(1, mask.size + 1)
    flat = [jnp.asarray(x.reshape(-1), jnp.float32) for x in (logp, old, adv, mask)]
    kw = dict(clip_high=0.28, dual_clip=3.0)
    g = masked_ppo_loss(*flat, sequence_ratio=True, segment_ids=jnp.asarray(ids), **kw)
    p = masked_ppo_loss(*flat, impl="reference", **kw)
    for name in PPOLossSums._fields:
        np.testing.assert_allclose(getattr(g, name), getattr(p, name), rtol=1e-6, err_msg=name)


def test_gspo_huge_log_ratio_stays_finite():
    logp = jnp.asarray([0.0, 0.0, 0.0])
    old = jnp.asarray([-5000.0, -5000.0, 0.0])
    adv, w, seg = jnp.asarray([1.0, 1.0, -1.0]), jnp.ones(3), jnp.asarray([1, 1, 2])
    (value, sums), grad = _loss_and_grad("reference", old, adv, w, sequence_ratio=True,
                                         segment_ids=seg)(logp)
    assert np.isfinite(float(value)) and np.all(np.isfinite(np.asarray(grad)))


@pytest.mark.parametrize("estimator", ["k1", "k3"])
def test_cispo_kernel_matches_reference_random(estimator):
    n = 2500
    rng = np.random.default_rng(11)
    logp = rng.normal(size=n) * 0.5 - 1.0
    old = jnp.asarray(logp + rng.normal(size=n) * 0.6, jnp.float32)
    adv = jnp.asarray(rng.normal(size=n) * 2.0, jnp.float32)
    w = jnp.asarray((rng.uniform(size=n) > 0.3) * rng.uniform(0.1, 1.0, size=n), jnp.float32)
    ref = jnp.asarray(logp + rng.normal(size=n) * 0.3, jnp.float32)
    lp = jnp.asarray(logp, jnp.float32)
    kw = dict(clip_high=0.28, kl_estimator=estimator, surrogate="weight")
    (v_ref, s_ref), g_ref = _loss_and_grad("reference", old, adv, w, ref, **kw)(lp)
    (v_k, s_k), g_k = _loss_and_grad("pallas", old, adv, w, ref, block_rows=8, **kw)(lp)
    for name in PPOLossSums._fields:
        np.testing.assert_allclose(getattr(s_k, name), getattr(s_ref, name), rtol=1e-5,
                                   atol=1e-4, err_msg=name)
    np.testing.assert_allclose(g_k, g_ref, rtol=1e-5, atol=1e-7)


@pytest.mark.parametrize("impl", IMPLS)
def test_cispo_takes_its_own_bounds_without_a_lower_one(impl):
    # MiniMax-M1: no lower bound on the IS weight (ε_lo ≥ 1), only ε_hi (here 5, as peers
    # run it). Ratios 0.1, 0.5, 4 and 7 with A = 1: weights 0.1, 0.5, 4, 6; the gradient
    # w.r.t. logp_t is −clip(r_t)·A_t. PPO's band (0 < ε_lo < 1) could not express this.
    ratio = np.array([0.1, 0.5, 4.0, 7.0])
    logp = jnp.zeros(4)
    old = jnp.asarray(-np.log(ratio), jnp.float32)
    adv, w = jnp.ones(4), jnp.ones(4)
    (_, sums), grad = _loss_and_grad(impl, old, adv, w, surrogate="weight", clip_low=1.0,
                                     clip_high=5.0)(logp)
    np.testing.assert_allclose(grad, [-0.1, -0.5, -4.0, -6.0], rtol=1e-5)
    assert (float(sums.clipfrac_low), float(sums.clipfrac_high)) == (0.0, 1.0)
    with pytest.raises(ValueError, match="0 < clip_low < 1"):
        masked_ppo_loss(logp, old, adv, w, clip_low=1.0)  # still PPO's rule for ppo


def test_variant_arguments_are_checked():
    x = jnp.zeros(4)
    with pytest.raises(ValueError, match="surrogate"):
        masked_ppo_loss(x, x, x, x, surrogate="grpo")
    with pytest.raises(ValueError, match="segment_ids"):
        masked_ppo_loss(x, x, x, x, sequence_ratio=True)
    with pytest.raises(ValueError, match="dual_clip"):
        masked_ppo_loss(x, x, x, x, surrogate="weight", dual_clip=3.0, impl="pallas")
