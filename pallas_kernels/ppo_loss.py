"""Masked PPO loss as weighted sums (Tunix style: the caller divides once per update).

Per token, with log-ratio ``d = clamp(logp − old, ±20)`` and ``r = exp(d)``:

    pg_t = max(−A·r, −A·clip(r, 1 − ε_lo, 1 + ε_hi))
    pg_t = min(pg_t, −A·c)                        dual clip, only where A < 0 (c = dual_clip)
    kl_t = k1: x    k2: ½x²    k3: exp(−x) − (−x) − 1   with  x = logp − ref  (k3: −x clamped ±20)

and the returned sums over tokens (``[w > 0]`` counts the tokens that carry weight):

    pg            = Σ w·pg_t
    kl            = Σ w·kl_t                      (0 without ref_logprobs)
    clipped       = Σ [w>0]·1[−A·clip(r) > −A·r]  (the clipped branch is the max: clipfrac)
    dual_clipped  = Σ [w>0]·1[A < 0 and pg_t before dual clip > −A·c]
    ratio         = Σ [w>0]·r
    approx_kl_old = Σ [w>0]·(old − logp)

The weights ``w`` encode the reduction; the caller builds them once per mini-batch:
token-mean → ``w = loss_mask`` (denominator: tokens in the mini-batch); seq-mean-token-mean →
``w = loss_mask / tokens-in-its-segment`` (denominator: segments). Tokens with ``w = 0``
(padding, masked rows, empty segments) contribute exactly 0 to every sum and to the gradient:
their inputs are replaced by zeros before any exp, so inf/NaN stored there never leaks.

Gradients flow to ``logprobs`` through ``pg`` and ``kl`` only: ``old_logprobs``,
``advantages``, ``loss_weights`` and ``ref_logprobs`` are constants, and the four diagnostics
are ``stop_gradient``-ed. The ±20 clamp of the log-ratio (as in verl) keeps ``exp`` finite so
that an A = 0 token cannot make ``0·inf = NaN``; beyond it the gradient is 0.

``impl``: "reference" (jnp, autodiff), "pallas" (forward kernel over token blocks emitting
per-block partial sums + backward kernel for ``dlogprobs``, under ``jax.custom_vjp``), "auto"
(pallas on TPU/GPU, reference on CPU).
"""

from __future__ import annotations

import dataclasses
import functools
from typing import NamedTuple

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl

from pallas_kernels.token_logprobs import default_platform

LOG_RATIO_CLAMP = 20.0
KL_ESTIMATORS = ("k1", "k2", "k3")
_LANES = 128
_F32 = jnp.float32


class PPOLossSums(NamedTuple):
    """Scalar fp32 sums; divide by the reduction's global denominator once per update."""

    pg: jax.Array
    kl: jax.Array
    clipped: jax.Array
    dual_clipped: jax.Array
    ratio: jax.Array
    approx_kl_old: jax.Array


@dataclasses.dataclass(frozen=True)
class _PPOConfig:
    clip_low: float
    clip_high: float
    dual_clip: float | None
    kl_estimator: str
    has_ref: bool
    block_rows: int
    interpret: bool


def _check(logprobs, others, clip_low, clip_high, dual_clip, kl_estimator):
    if logprobs.ndim != 1:
        raise ValueError(f"logprobs must be 1-D [N], got {logprobs.shape}")
    for name, x in others.items():
        if x is not None and x.shape != logprobs.shape:
            raise ValueError(f"{name} must have shape {logprobs.shape}, got {x.shape}")
    clip_high = clip_low if clip_high is None else clip_high
    if not (0 < clip_low < 1 and clip_high > 0):
        raise ValueError(f"need 0 < clip_low < 1 and clip_high > 0, got {clip_low}, {clip_high}")
    if dual_clip is not None and not dual_clip > 1:
        raise ValueError(f"dual_clip must be > 1, got {dual_clip}")
    if kl_estimator not in KL_ESTIMATORS:
        raise ValueError(f"unknown kl_estimator {kl_estimator!r}; expected {KL_ESTIMATORS}")
    return float(clip_low), float(clip_high), None if dual_clip is None else float(dual_clip)


# ----------------------------------------------------------------------------- reference


def reference_ppo_loss(logprobs, old_logprobs, advantages, loss_weights, ref_logprobs=None, *,
                       clip_low=0.2, clip_high=None, dual_clip=None, kl_estimator="k3"):
    """Plain jnp; gradients by autodiff."""
    clip_low, clip_high, dual_clip = _check(
        logprobs, dict(old_logprobs=old_logprobs, advantages=advantages,
                       loss_weights=loss_weights, ref_logprobs=ref_logprobs),
        clip_low, clip_high, dual_clip, kl_estimator)
    sg = lax.stop_gradient
    logp = logprobs.astype(_F32)
    w = sg(loss_weights.astype(_F32))
    active = w != 0
    counted = (w > 0).astype(_F32)
    log_ratio = jnp.where(active, logp - sg(old_logprobs.astype(_F32)), 0.0)
    log_ratio = lax.clamp(-LOG_RATIO_CLAMP, log_ratio, LOG_RATIO_CLAMP)
    adv = jnp.where(active, sg(advantages.astype(_F32)), 0.0)
    ratio = jnp.exp(log_ratio)
    unclipped = -adv * ratio
    clipped = -adv * jnp.clip(ratio, 1.0 - clip_low, 1.0 + clip_high)
    pg = jnp.maximum(unclipped, clipped)
    dual_active = jnp.zeros_like(active)
    if dual_clip is not None:
        bound = -adv * dual_clip
        dual_active = (adv < 0) & (pg > bound)
        pg = jnp.where(adv < 0, jnp.minimum(pg, bound), pg)
    if ref_logprobs is None:
        kl = jnp.zeros((), _F32)
    else:
        x = jnp.where(active, logp - sg(ref_logprobs.astype(_F32)), 0.0)
        if kl_estimator == "k1":
            kl_t = x
        elif kl_estimator == "k2":
            kl_t = 0.5 * x * x
        else:
            e = lax.clamp(-LOG_RATIO_CLAMP, -x, LOG_RATIO_CLAMP)
            kl_t = jnp.exp(e) - e - 1.0
        kl = jnp.sum(w * kl_t)
    return PPOLossSums(
        pg=jnp.sum(w * pg),
        kl=kl,
        clipped=sg(jnp.sum(counted * (clipped > unclipped))),
        dual_clipped=sg(jnp.sum(counted * dual_active)),
        ratio=sg(jnp.sum(counted * ratio)),
        approx_kl_old=sg(jnp.sum(counted * -log_ratio)),
    )


# ----------------------------------------------------------------------------- kernels


def _token_terms(cfg: _PPOConfig, logp, old, adv, w, ref):
    """Per-token values and their derivatives w.r.t. logp (hand-derived, no autodiff)."""
    active = w != 0
    raw = jnp.where(active, logp - old, 0.0)
    log_ratio = jnp.clip(raw, -LOG_RATIO_CLAMP, LOG_RATIO_CLAMP)
    adv = jnp.where(active, adv, 0.0)
    ratio = jnp.exp(log_ratio)
    unclipped = -adv * ratio
    clipped = -adv * jnp.clip(ratio, 1.0 - cfg.clip_low, 1.0 + cfg.clip_high)
    clip_active = clipped > unclipped
    pg = jnp.maximum(unclipped, clipped)
    # d(−A·r)/dlogp = −A·r inside the clamp; the clipped branch is flat where it wins.
    d_pg = jnp.where(clip_active | (jnp.abs(raw) >= LOG_RATIO_CLAMP), 0.0, unclipped)
    dual_active = jnp.zeros_like(active)
    if cfg.dual_clip is not None:
        bound = -adv * cfg.dual_clip
        dual_active = (adv < 0) & (pg > bound)
        pg = jnp.where(dual_active, bound, pg)
        d_pg = jnp.where(dual_active, 0.0, d_pg)
    if cfg.has_ref:
        x = jnp.where(active, logp - ref, 0.0)
        if cfg.kl_estimator == "k1":
            kl, d_kl = x, jnp.ones_like(x)
        elif cfg.kl_estimator == "k2":
            kl, d_kl = 0.5 * x * x, x
        else:
            e = jnp.clip(-x, -LOG_RATIO_CLAMP, LOG_RATIO_CLAMP)
            exp_e = jnp.exp(e)
            kl = exp_e - e - 1.0
            d_kl = jnp.where(jnp.abs(x) >= LOG_RATIO_CLAMP, 0.0, 1.0 - exp_e)
    else:
        kl = d_kl = jnp.zeros_like(logp)
    counted = jnp.where(w > 0, 1.0, 0.0)
    sums = (w * pg, w * kl, counted * jnp.where(clip_active, 1.0, 0.0),
            counted * jnp.where(dual_active, 1.0, 0.0), counted * ratio, counted * -log_ratio)
    return sums, w * d_pg, w * d_kl


def _fwd_kernel(*refs, cfg):
    n_in = 5 if cfg.has_ref else 4
    values = [r[...] for r in refs[:n_in]]
    sums, _, _ = _token_terms(cfg, *values, *([None] * (5 - n_in)))
    for out_ref, token_values in zip(refs[n_in:], sums, strict=True):
        out_ref[...] = jnp.sum(token_values, axis=0, keepdims=True)


def _bwd_kernel(*refs, cfg):
    n_in = 5 if cfg.has_ref else 4
    values = [r[...] for r in refs[:n_in]]
    g_ref, out_ref = refs[n_in:]
    _, d_pg, d_kl = _token_terms(cfg, *values, *([None] * (5 - n_in)))
    grad = g_ref[pl.ds(0, 1), :] * d_pg
    if cfg.has_ref:
        grad = grad + g_ref[pl.ds(1, 1), :] * d_kl
    out_ref[...] = grad


def _as_tiles(x, rows: int):
    """``[N]`` → zero-padded fp32 ``[rows, 128]`` (tokens on lanes, TPU/GPU friendly)."""
    x = x.astype(_F32)
    return jnp.pad(x, (0, rows * _LANES - x.shape[0])).reshape(rows, _LANES)


def _tile_inputs(cfg, logprobs, old, adv, w, ref):
    n = logprobs.shape[0]
    rows = pl.cdiv(max(pl.cdiv(n, _LANES), 1), cfg.block_rows) * cfg.block_rows
    xs = [logprobs, old, adv, w] + ([ref] if cfg.has_ref else [])
    # Padding tokens get w = 0, hence contribute nothing.
    return [_as_tiles(x, rows) for x in xs], rows


def _pallas_sums(cfg: _PPOConfig, logprobs, old, adv, w, ref):
    tiles, rows = _tile_inputs(cfg, logprobs, old, adv, w, ref)
    n_blocks = rows // cfg.block_rows
    block = pl.BlockSpec((cfg.block_rows, _LANES), lambda i: (i, 0))
    partial = pl.BlockSpec((None, 1, _LANES), lambda i: (i, 0, 0))
    parts = pl.pallas_call(
        functools.partial(_fwd_kernel, cfg=cfg),
        out_shape=[jax.ShapeDtypeStruct((n_blocks, 1, _LANES), _F32)] * 6,
        grid=(n_blocks,),
        in_specs=[block] * len(tiles),
        out_specs=[partial] * 6,
        interpret=cfg.interpret,
        name="masked_ppo_loss_fwd",
    )(*tiles)
    return PPOLossSums(*(jnp.sum(p) for p in parts))


@functools.partial(jax.custom_vjp, nondiff_argnums=(0,))
def _pallas_ppo(cfg, logprobs, old, adv, w, ref):
    return _pallas_sums(cfg, logprobs, old, adv, w, ref)


def _pallas_ppo_fwd(cfg, logprobs, old, adv, w, ref):
    return _pallas_sums(cfg, logprobs, old, adv, w, ref), (logprobs, old, adv, w, ref)


def _pallas_ppo_bwd(cfg, residuals, g):
    logprobs, old, adv, w, ref = residuals
    tiles, rows = _tile_inputs(cfg, logprobs, old, adv, w, ref)
    # Only pg and kl carry gradient; the diagnostics are stop_gradient by definition.
    g_rows = jnp.broadcast_to(jnp.stack([g.pg, g.kl]).astype(_F32)[:, None], (2, _LANES))
    block = pl.BlockSpec((cfg.block_rows, _LANES), lambda i: (i, 0))
    grad = pl.pallas_call(
        functools.partial(_bwd_kernel, cfg=cfg),
        out_shape=jax.ShapeDtypeStruct((rows, _LANES), _F32),
        grid=(rows // cfg.block_rows,),
        in_specs=[block] * len(tiles) + [pl.BlockSpec((2, _LANES), lambda i: (0, 0))],
        out_specs=block,
        interpret=cfg.interpret,
        name="masked_ppo_loss_bwd",
    )(*tiles, g_rows)
    dlogp = grad.reshape(-1)[: logprobs.shape[0]].astype(logprobs.dtype)
    return dlogp, None, None, None, None


_pallas_ppo.defvjp(_pallas_ppo_fwd, _pallas_ppo_bwd)


def _block_rows(n: int) -> int:
    """Rows of 128 tokens per block: a power of two (GPU) and a multiple of 8 (TPU), ≤ 64."""
    rows = max(-(-n // _LANES), 1)
    return min(64, max(8, 1 << (rows - 1).bit_length()))


def masked_ppo_loss(logprobs, old_logprobs, advantages, loss_weights, ref_logprobs=None, *,
                    clip_low=0.2, clip_high=None, dual_clip=None, kl_estimator="k3",
                    impl="auto", block_rows=None, interpret=None) -> PPOLossSums:
    """PPO-clip policy loss and KL-to-reference as weighted sums over ``[N]`` tokens.

    All inputs are 1-D ``[N]``; ``clip_high=None`` means ``clip_low``; ``dual_clip`` (e.g.
    3.0) enables the dual clip for negative advantages. See the module docstring.
    """
    if impl not in ("auto", "reference", "pallas"):
        raise ValueError(f"unknown impl {impl!r}; expected 'auto', 'reference' or 'pallas'")
    platform = default_platform()
    if impl == "auto":
        impl = "pallas" if platform in ("tpu", "gpu") else "reference"
    if impl == "reference":
        return reference_ppo_loss(logprobs, old_logprobs, advantages, loss_weights,
                                  ref_logprobs, clip_low=clip_low, clip_high=clip_high,
                                  dual_clip=dual_clip, kl_estimator=kl_estimator)
    clip_low, clip_high, dual_clip = _check(
        logprobs, dict(old_logprobs=old_logprobs, advantages=advantages,
                       loss_weights=loss_weights, ref_logprobs=ref_logprobs),
        clip_low, clip_high, dual_clip, kl_estimator)
    block_rows = _block_rows(logprobs.shape[0]) if block_rows is None else int(block_rows)
    if block_rows % 8 or block_rows & (block_rows - 1):
        raise ValueError(f"block_rows must be a power of two and a multiple of 8, "
                         f"got {block_rows}")
    cfg = _PPOConfig(clip_low, clip_high, dual_clip, kl_estimator, ref_logprobs is not None,
                     block_rows, platform == "cpu" if interpret is None else bool(interpret))
    return _pallas_ppo(cfg, logprobs, old_logprobs, advantages, loss_weights, ref_logprobs)
