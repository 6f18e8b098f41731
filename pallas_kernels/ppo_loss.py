"""Masked PPO-family policy losses as weighted sums (Tunix style: divide once per update).

The kernel computes forms, not named algorithms (the names live in
``jaxrl_agentic.algos.policy_losses``): ``surrogate`` picks the per-token term and
``sequence_ratio`` the ratio. With the token log-ratio ``d_t = logp_t − old_t``, clamping
``clamp(·, ±20)`` and ``clip(x) = clip(x, 1 − ε_lo, 1 + ε_hi)``:

    ratio r_t = exp(clamp(d_t))                                   sequence_ratio=False
    ratio s_t = sg(s_i)·π_t / sg(π_t),  s_i = exp(clamp(mean_{u ∈ i} d_u))    =True
          one ratio per sample (segment) i, the mean over its loss tokens (w ≠ 0); token
          t's copy carries only logp_t's gradient (GSPO-token)

    surrogate="clip":    pg_t = max(−A_t·r_t, −A_t·clip(r_t))       (PPO; GSPO with s_t)
    surrogate="weight":  pg_t = −sg(clip(r_t))·A_t·logp_t           (CISPO: no token leaves
                                                                    the gradient; sg = stop grad)

    pg_t = min(pg_t, −A·c)                        dual clip (surrogate="clip"), where A < 0
    kl_t = k1: x    k2: ½x²    k3: exp(−x) − (−x) − 1   with  x = logp − ref  (k3: −x clamped ±20)

GSPO (Zheng et al. 2025, "Group Sequence Policy Optimization"), in its GSPO-token form: every
token of sample ``i`` sees the value ``s_i``, and token ``u`` gets the gradient
``−w_u·A_u·s_i·∇logp_u`` (0 where its branch is clipped or ``|mean d| ≥ 20``), as verl's
``log s_t = logp_t − sg(logp_t) + sg(mean d)``. With one advantage per sample this equals the
sequence form ``−A·∇s_i``; with per-token or per-turn advantages (turn_grpo, gigpo, gae,
merged step samples, TIS folded into A) the sequence form would spread the sample's mean
advantage over every token instead. ``segment_ids`` ([N]) identify the samples: each sample is one
contiguous run of equal ids, and neighbouring samples have different ids (for a flattened
``[B, T]`` packed batch offset the ids per row, e.g. ``algos.losses.flat_segment_ids``).
CISPO (MiniMax-M1, 2025): the clipped importance weight is a constant, so a token whose
ratio PPO would clip still contributes ``−clip(r)·A·∇logp``; the reported ``pg`` is the
surrogate's value, whose scale depends on ``logp`` (only its gradient is meaningful).

and the returned sums over tokens (``[w > 0]`` counts the tokens that carry weight), named as
the run logs them (``actor/<name>``, divided by D or by the token count):

    pg_loss       = Σ w·pg_t
    kl            = Σ w·kl_t                      (0 without ref_logprobs)
    clipfrac      = Σ [w>0]·1[−A·clip(r) > −A·r]  (the clipped branch is the max)
    dual_clipfrac = Σ [w>0]·1[A < 0 and pg_t before dual clip > −A·c]
    ratio         = Σ [w>0]·r                     (sequence ratio: s_i on each token)
    approx_kl     = Σ [w>0]·(old − logp)          (token level for every variant)
    clipfrac_low  = Σ [w>0]·1[clipped and A < 0]  (r < 1 − ε_lo: a drop was capped)
    clipfrac_high = Σ [w>0]·1[clipped and A > 0]  (r > 1 + ε_hi: a rise was capped)

so ``clipfrac = clipfrac_low + clipfrac_high``. For the weight surrogate nothing is clipped
out of the gradient; there ``clipfrac`` counts tokens whose weight was truncated,
``clipfrac_low`` those with ``r < 1 − ε_lo`` and ``clipfrac_high`` those with
``r > 1 + ε_hi`` (whatever the sign of A).

The weights ``w`` encode the reduction; the caller builds them once per mini-batch:
token-mean → ``w = loss_mask`` (denominator: tokens in the mini-batch); seq-mean-token-mean →
``w = loss_mask / tokens-in-its-segment`` (denominator: segments). Tokens with ``w = 0``
(padding, masked rows, empty segments) contribute exactly 0 to every sum and to the gradient:
their inputs are replaced by zeros before any exp, so inf/NaN stored there never leaks.

Gradients flow to ``logprobs`` through ``pg_loss`` and ``kl`` only: ``old_logprobs``,
``advantages``, ``loss_weights`` and ``ref_logprobs`` are constants, and the four diagnostics
are ``stop_gradient``-ed. The ±20 clamp of the log-ratio (as in verl) keeps ``exp`` finite so
that an A = 0 token cannot make ``0·inf = NaN``; beyond it the gradient is 0.

``impl``: "reference" (jnp, autodiff), "pallas" (forward kernel over token blocks emitting
per-block partial sums + backward kernel for ``dlogprobs``, under ``jax.custom_vjp``), "auto"
(pallas on TPU/GPU, reference on CPU). Token ratios run in the kernel; **a sequence ratio
always runs the reference** (its per-sample mean is a segment reduction across token blocks,
and what follows it is elementwise work that XLA fuses anyway), whatever ``impl`` says.
"""

from __future__ import annotations

import dataclasses
import functools
from typing import NamedTuple

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as pltriton

from pallas_kernels._per_shard import P, kernel_mesh, per_shard, token_spec
from pallas_kernels._target import per_target
from pallas_kernels.token_logprobs import default_platform

LOG_RATIO_CLAMP = 20.0
KL_ESTIMATORS = ("k1", "k2", "k3")
SURROGATES = ("clip", "weight")
_LANES = 128
_F32 = jnp.float32


class PPOLossSums(NamedTuple):
    """Scalar fp32 sums; divide by the reduction's global denominator once per update."""

    pg_loss: jax.Array
    kl: jax.Array
    clipfrac: jax.Array
    dual_clipfrac: jax.Array
    ratio: jax.Array
    approx_kl: jax.Array
    clipfrac_low: jax.Array
    clipfrac_high: jax.Array


_N_SUMS = len(PPOLossSums._fields)


@dataclasses.dataclass(frozen=True)
class _PPOConfig:
    clip_low: float
    clip_high: float
    dual_clip: float | None
    kl_estimator: str
    has_ref: bool
    block_rows: int
    interpret: bool | None  # None: chosen for the platform lowered for (`_target`)
    surrogate: str = "clip"
    platform: str = "cpu"

    def compiler_params(self, interpret: bool):
        """Triton's, named, on a GPU: a ``pallas_call`` without them lowers to Mosaic GPU
        where JAX's ``jax_pallas_use_mosaic_gpu`` is on (the default of JAX 0.10), which
        cannot lower this kernel's row sums ("No support for axes yet";
        ``tests/pallas_kernels/test_lowering.py``). TPU: Mosaic's defaults."""
        if interpret or self.platform != "gpu":
            return None
        return pltriton.CompilerParams(num_warps=4, num_stages=1)


def _check(logprobs, others, clip_low, clip_high, dual_clip, kl_estimator, surrogate="clip",
           sequence_ratio=False):
    if surrogate not in SURROGATES:
        raise ValueError(f"unknown surrogate {surrogate!r}; expected one of {SURROGATES}")
    if sequence_ratio and others.get("segment_ids") is None:
        raise ValueError("sequence_ratio needs segment_ids (the ratio is per sample)")
    if surrogate == "weight" and dual_clip is not None:
        # CISPO's weight is already bounded by 1 + ε_hi; a dual clip has nothing to bound.
        raise ValueError("dual_clip bounds the clipped surrogate, not surrogate='weight'")
    if logprobs.ndim != 1:
        raise ValueError(f"logprobs must be 1-D [N], got {logprobs.shape}")
    for name, x in others.items():
        if x is not None and x.shape != logprobs.shape:
            raise ValueError(f"{name} must have shape {logprobs.shape}, got {x.shape}")
    clip_high = clip_low if clip_high is None else clip_high
    # CISPO bounds a weight, not a ratio PPO can clip from both sides: clip_low ≥ 1 there
    # means no lower bound (MiniMax-M1); PPO's band needs 0 < 1 − ε_lo.
    weight = surrogate == "weight"
    if not ((clip_low >= 0 if weight else 0 < clip_low < 1) and clip_high > 0):
        raise ValueError(f"need {'clip_low >= 0' if weight else '0 < clip_low < 1'} and "
                         f"clip_high > 0, got {clip_low}, {clip_high}")
    if dual_clip is not None and not dual_clip > 1:
        raise ValueError(f"dual_clip must be > 1, got {dual_clip}")
    if kl_estimator not in KL_ESTIMATORS:
        raise ValueError(f"unknown kl_estimator {kl_estimator!r}; expected {KL_ESTIMATORS}")
    return float(clip_low), float(clip_high), None if dual_clip is None else float(dual_clip)


# ----------------------------------------------------------------------------- reference


def sequence_mean(values, active, segment_ids):
    """``mean_{u ∈ i, active} values_u`` of each token's sample ``i``, broadcast to ``[N]``.

    A sample is a contiguous run of equal ``segment_ids``; runs are numbered with a cumsum
    over id changes, so the ids need only differ between neighbours and ``segment_sum`` needs
    at most N segments (static). Inactive tokens add nothing; an all-inactive run gives 0.
    """
    ids = jnp.asarray(segment_ids)
    starts = jnp.concatenate([jnp.ones((1,), bool), ids[1:] != ids[:-1]])
    run = jnp.cumsum(starts.astype(jnp.int32)) - 1
    n = ids.shape[0]
    active = active.astype(_F32)
    total = jax.ops.segment_sum(jnp.where(active > 0, values, 0.0), run, num_segments=n)
    count = jax.ops.segment_sum(active, run, num_segments=n)
    return (total / jnp.maximum(count, 1.0))[run]


def _clamp_log_ratio(x):
    return lax.clamp(-LOG_RATIO_CLAMP, x, LOG_RATIO_CLAMP)


def reference_ppo_loss(logprobs, old_logprobs, advantages, loss_weights, ref_logprobs=None, *,
                       clip_low=0.2, clip_high=None, dual_clip=None, kl_estimator="k3",
                       surrogate="clip", sequence_ratio=False, segment_ids=None):
    """Plain jnp; gradients by autodiff."""
    clip_low, clip_high, dual_clip = _check(
        logprobs, dict(old_logprobs=old_logprobs, advantages=advantages,
                       loss_weights=loss_weights, ref_logprobs=ref_logprobs,
                       segment_ids=segment_ids),
        clip_low, clip_high, dual_clip, kl_estimator, surrogate, sequence_ratio)
    sg = lax.stop_gradient
    logp = logprobs.astype(_F32)
    w = sg(loss_weights.astype(_F32))
    active = w != 0
    counted = (w > 0).astype(_F32)
    log_ratio = jnp.where(active, logp - sg(old_logprobs.astype(_F32)), 0.0)
    token_log_ratio = _clamp_log_ratio(log_ratio)
    if sequence_ratio:
        # GSPO-token (module doc): the value is the sample's clamped mean log-ratio, the
        # gradient is each token's own logp's, and none beyond the clamp (as for ppo).
        seq = sequence_mean(log_ratio, active, segment_ids)
        inside = active & (jnp.abs(seq) < LOG_RATIO_CLAMP)
        own = jnp.where(inside, logp - sg(logp), 0.0)
        log_ratio = jnp.where(active, own + sg(_clamp_log_ratio(seq)), 0.0)
    else:
        log_ratio = _clamp_log_ratio(log_ratio)
    adv = jnp.where(active, sg(advantages.astype(_F32)), 0.0)
    ratio = jnp.exp(log_ratio)
    dual_active = jnp.zeros_like(active)
    if surrogate == "weight":
        weight = jnp.clip(ratio, 1.0 - clip_low, 1.0 + clip_high)
        pg = -adv * sg(weight) * jnp.where(active, logp, 0.0)
        clip_low_t = ratio < 1.0 - clip_low
        clip_high_t = ratio > 1.0 + clip_high
        clip_t = clip_low_t | clip_high_t
    else:
        unclipped = -adv * ratio
        clipped = -adv * jnp.clip(ratio, 1.0 - clip_low, 1.0 + clip_high)
        pg = jnp.maximum(unclipped, clipped)
        clip_t = clipped > unclipped
        clip_low_t = clip_t & (adv < 0)
        clip_high_t = clip_t & (adv > 0)
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
        pg_loss=jnp.sum(w * pg),
        kl=kl,
        clipfrac=sg(jnp.sum(counted * clip_t)),
        dual_clipfrac=sg(jnp.sum(counted * dual_active)),
        ratio=sg(jnp.sum(counted * ratio)),
        approx_kl=sg(jnp.sum(counted * -token_log_ratio)),
        clipfrac_low=sg(jnp.sum(counted * clip_low_t)),
        clipfrac_high=sg(jnp.sum(counted * clip_high_t)),
    )


# ----------------------------------------------------------------------------- kernels


def _token_terms(cfg: _PPOConfig, logp, old, adv, w, ref):
    """Per-token values and their derivatives w.r.t. logp (hand-derived, no autodiff)."""
    active = w != 0
    raw = jnp.where(active, logp - old, 0.0)
    log_ratio = jnp.clip(raw, -LOG_RATIO_CLAMP, LOG_RATIO_CLAMP)
    adv = jnp.where(active, adv, 0.0)
    ratio = jnp.exp(log_ratio)
    if cfg.surrogate == "weight":
        # −sg(clip(r))·A·logp: the weight is a constant, so d/dlogp = −clip(r)·A everywhere.
        weight = jnp.clip(ratio, 1.0 - cfg.clip_low, 1.0 + cfg.clip_high)
        low = ratio < 1.0 - cfg.clip_low
        high = ratio > 1.0 + cfg.clip_high
        clip_active = low | high
        d_pg = -adv * weight
        pg = d_pg * jnp.where(active, logp, 0.0)
    else:
        unclipped = -adv * ratio
        clipped = -adv * jnp.clip(ratio, 1.0 - cfg.clip_low, 1.0 + cfg.clip_high)
        clip_active = clipped > unclipped
        low = clip_active & (adv < 0)
        high = clip_active & (adv > 0)
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
            counted * jnp.where(dual_active, 1.0, 0.0), counted * ratio, counted * -log_ratio,
            counted * jnp.where(low, 1.0, 0.0), counted * jnp.where(high, 1.0, 0.0))
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

    def run(interpret, *tiles):
        return pl.pallas_call(
            functools.partial(_fwd_kernel, cfg=cfg),
            out_shape=[jax.ShapeDtypeStruct((n_blocks, 1, _LANES), _F32)] * _N_SUMS,
            grid=(n_blocks,),
            in_specs=[block] * len(tiles),
            out_specs=[partial] * _N_SUMS,
            compiler_params=cfg.compiler_params(interpret),
            interpret=interpret,
            name="masked_ppo_loss_fwd",
        )(*tiles)

    parts = per_target(run, *tiles, interpret=cfg.interpret)
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
    g_rows = jnp.broadcast_to(jnp.stack([g.pg_loss, g.kl]).astype(_F32)[:, None], (2, _LANES))
    block = pl.BlockSpec((cfg.block_rows, _LANES), lambda i: (i, 0))

    def run(interpret, *operands):
        return pl.pallas_call(
            functools.partial(_bwd_kernel, cfg=cfg),
            out_shape=jax.ShapeDtypeStruct((rows, _LANES), _F32),
            grid=(rows // cfg.block_rows,),
            in_specs=[block] * len(tiles) + [pl.BlockSpec((2, _LANES), lambda i: (0, 0))],
            out_specs=block,
            compiler_params=cfg.compiler_params(interpret),
            interpret=interpret,
            name="masked_ppo_loss_bwd",
        )(*operands)

    grad = per_target(run, *tiles, g_rows, interpret=cfg.interpret)
    dlogp = grad.reshape(-1)[: logprobs.shape[0]].astype(logprobs.dtype)
    return dlogp, None, None, None, None


_pallas_ppo.defvjp(_pallas_ppo_fwd, _pallas_ppo_bwd)


def _block_rows(n: int) -> int:
    """Rows of 128 tokens per block: a power of two (GPU) and a multiple of 8 (TPU), ≤ 64."""
    rows = max(-(-n // _LANES), 1)
    return min(64, max(8, 1 << (rows - 1).bit_length()))


def masked_ppo_loss(logprobs, old_logprobs, advantages, loss_weights, ref_logprobs=None, *,
                    clip_low=0.2, clip_high=None, dual_clip=None, kl_estimator="k3",
                    surrogate="clip", sequence_ratio=False, segment_ids=None, impl="auto",
                    block_rows=None,
                    interpret=None) -> PPOLossSums:
    """PPO-family policy loss and KL-to-reference as weighted sums over ``[N]`` tokens.

    All inputs are 1-D ``[N]``; ``clip_high=None`` means ``clip_low``; ``dual_clip`` (e.g.
    3.0) enables the dual clip for negative advantages (``surrogate="clip"``). ``surrogate``
    is one of ``SURROGATES``; ``sequence_ratio`` needs ``segment_ids`` ``[N]`` (module doc)
    and always runs the reference path. ``interpret`` None: interpret mode in the program
    lowered for a CPU, the kernel in one lowered for a TPU or GPU (``_target``). See the
    module docstring.
    """
    if impl not in ("auto", "reference", "pallas"):
        raise ValueError(f"unknown impl {impl!r}; expected 'auto', 'reference' or 'pallas'")
    platform = default_platform()
    if impl == "auto":
        impl = "pallas" if platform in ("tpu", "gpu") else "reference"
    if impl == "reference" or sequence_ratio:
        return reference_ppo_loss(logprobs, old_logprobs, advantages, loss_weights,
                                  ref_logprobs, clip_low=clip_low, clip_high=clip_high,
                                  dual_clip=dual_clip, kl_estimator=kl_estimator,
                                  surrogate=surrogate, sequence_ratio=bool(sequence_ratio),
                                  segment_ids=segment_ids)
    clip_low, clip_high, dual_clip = _check(
        logprobs, dict(old_logprobs=old_logprobs, advantages=advantages,
                       loss_weights=loss_weights, ref_logprobs=ref_logprobs),
        clip_low, clip_high, dual_clip, kl_estimator, surrogate)
    block_rows = _block_rows(logprobs.shape[0]) if block_rows is None else int(block_rows)
    if block_rows % 8 or block_rows & (block_rows - 1):
        raise ValueError(f"block_rows must be a power of two and a multiple of 8, "
                         f"got {block_rows}")
    cfg = _PPOConfig(clip_low, clip_high, dual_clip, kl_estimator, ref_logprobs is not None,
                     block_rows, None if interpret is None else bool(interpret),
                     surrogate, platform)
    return _sums_per_device(cfg, logprobs, old_logprobs, advantages, loss_weights, ref_logprobs)


def _sums_per_device(cfg, logprobs, old, adv, w, ref):
    """The kernel on each device's tokens (``_per_shard``), its partial sums added up outside
    the ``shard_map`` (so the gradient needs no collective of its own); when the tokens do
    not divide over the devices, every device sums them all and one copy is kept."""
    tokens = (logprobs, old, adv, w) + ((ref,) if cfg.has_ref else ())

    def kernel(*xs):
        sums = _pallas_ppo(cfg, *xs[:4], xs[4] if cfg.has_ref else None)
        return tuple(s.reshape(1) for s in sums)

    mesh = kernel_mesh()
    if mesh is None:
        return _pallas_ppo(cfg, logprobs, old, adv, w, ref)
    rows = token_spec(mesh, logprobs.shape[0])
    parts = per_shard(kernel, lambda mesh: ((P(rows),) * len(tokens),
                                            (P(rows),) * _N_SUMS))(*tokens)
    if rows is None:  # one full copy per device: keep one
        return PPOLossSums(*(p[0] for p in parts))
    return PPOLossSums(*(jnp.sum(p) for p in parts))
