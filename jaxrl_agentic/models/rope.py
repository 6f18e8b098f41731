"""Rotary position embeddings with the scaling rules used by Qwen2.5/Qwen3/Llama 3 checkpoints.

Inverse frequencies (computed once, on the host, in float32 like `transformers`):

    default:  inv_freq_i = theta^(-2i/d)
    linear:   inv_freq_i / factor
    llama3:   low frequencies (wavelength > L/low_ff) divided by `factor`, high frequencies
              (wavelength < L/high_ff) kept, a smooth blend in between, L = original context
    yarn:     blend of interpolated (inv_freq/factor) and extrapolated frequencies over a
              linear ramp in dimension space; cos/sin scaled by 0.1·ln(factor) + 1

Rotation ("rotate half" convention of HF checkpoints): with x = [x1, x2] split in halves,
    rope(x, p) = x·cos(p·f) + [−x2, x1]·sin(p·f),   f = [inv_freq, inv_freq].
"""

from __future__ import annotations

import math

import jax.numpy as jnp
import numpy as np

from jaxrl_agentic.models.config import ModelConfig


def _yarn(base: float, dim: int, params: dict) -> tuple[np.ndarray, float]:
    factor = float(params["factor"])
    original = params["original_max_position_embeddings"]
    attention_factor = params.get("attention_factor")
    if attention_factor is None:
        mscale, mscale_all = params.get("mscale"), params.get("mscale_all_dim")

        def get_mscale(scale, m=1.0):
            return 1.0 if scale <= 1 else 0.1 * m * math.log(scale) + 1.0

        if mscale and mscale_all:
            attention_factor = get_mscale(factor, mscale) / get_mscale(factor, mscale_all)
        else:
            attention_factor = get_mscale(factor)
    beta_fast = params.get("beta_fast") or 32
    beta_slow = params.get("beta_slow") or 1

    def correction_dim(rotations):
        return dim * math.log(original / (rotations * 2 * math.pi)) / (2 * math.log(base))

    low, high = correction_dim(beta_fast), correction_dim(beta_slow)
    if params.get("truncate", True):
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, dim - 1)
    if low == high:
        high += 0.001  # avoid a zero-width ramp
    ramp = np.clip((np.arange(dim // 2, dtype=np.float32) - low) / (high - low), 0, 1)
    pos_freqs = base ** (np.arange(0, dim, 2, dtype=np.float32) / dim)
    extrapolation, interpolation = 1.0 / pos_freqs, 1.0 / (factor * pos_freqs)
    keep = 1 - ramp  # 1 → keep the original (extrapolated) frequency
    inv_freq = interpolation * (1 - keep) + extrapolation * keep
    return inv_freq.astype(np.float32), float(attention_factor)


def _llama3(inv_freq: np.ndarray, params: dict) -> np.ndarray:
    factor = params["factor"]
    low_ff, high_ff = params["low_freq_factor"], params["high_freq_factor"]
    original = params["original_max_position_embeddings"]
    low_wavelen, high_wavelen = original / low_ff, original / high_ff
    wavelen = 2 * math.pi / inv_freq
    scaled = np.where(wavelen > low_wavelen, inv_freq / factor, inv_freq)
    smooth = (original / wavelen - low_ff) / (high_ff - low_ff)
    blended = (1 - smooth) * scaled / factor + smooth * scaled
    medium = ~(wavelen < high_wavelen) & ~(wavelen > low_wavelen)
    return np.where(medium, blended, scaled).astype(np.float32)


def rope_frequencies(cfg: ModelConfig) -> tuple[np.ndarray, float]:
    """(inv_freq [head_dim/2] float32, attention scaling applied to cos/sin)."""
    dim = cfg.head_dim
    exponents = np.arange(0, dim, 2, dtype=np.int64).astype(np.float32) / dim
    inv_freq = 1.0 / (cfg.rope_theta**exponents)
    inv_freq = inv_freq.astype(np.float32)
    params, kind = cfg.rope_params, cfg.rope_type
    if kind == "default":
        return inv_freq, 1.0
    if kind == "linear":
        return (inv_freq / params["factor"]).astype(np.float32), 1.0
    if kind == "llama3":
        return _llama3(inv_freq, params), 1.0
    if kind == "yarn":
        return _yarn(cfg.rope_theta, dim, params)
    raise ValueError(f"unsupported rope_type {kind!r}")


def rope_cos_sin(positions: jnp.ndarray, inv_freq, scale: float):
    """cos, sin of shape [*positions.shape, head_dim], float32."""
    angles = positions.astype(jnp.float32)[..., None] * jnp.asarray(inv_freq, jnp.float32)
    angles = jnp.concatenate([angles, angles], axis=-1)
    return jnp.cos(angles) * scale, jnp.sin(angles) * scale


def apply_rope(x: jnp.ndarray, cos: jnp.ndarray, sin: jnp.ndarray) -> jnp.ndarray:
    """x: [B, T, heads, head_dim]; cos/sin: [B, T, head_dim]."""
    half = x.shape[-1] // 2
    rotated = jnp.concatenate([-x[..., half:], x[..., :half]], axis=-1)
    cos, sin = cos[:, :, None, :], sin[:, :, None, :]
    out = x.astype(jnp.float32) * cos + rotated.astype(jnp.float32) * sin
    return out.astype(x.dtype)
