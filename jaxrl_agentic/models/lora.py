"""Low-rank adapters (LoRA) on the decoder's projections, trained while the base is frozen.

A targeted projection y = x·W (+ b) becomes

    y = x·W (+ b) + s · (x·A)·B,        A [n_in, r],  B [r, n_out],  s = alpha / r

with A drawn like a projection's weights (normal, std 1/√n_in) and B = 0, so the model's
first forward is the base's exactly. The adapters are `nnx.LoRAParam`s beside the weight
they adapt (`layers/attn/q_proj/lora_a`, stacked over layers like the weight), and the
low-rank path is computed as two thin matmuls, never as a merged W + s·A·B: the base keeps
its storage dtype and is read as it is, the gradient reaches A and B through the thin
products (dA = s·xᵀ·(dy·Bᵀ), dB = s·(x·A)ᵀ·dy) without a dense dW, and the sampler decodes
with base and adapters as they are stored.

`split_trainable(model)` separates what the learner trains (the adapters) from what it
holds fixed (everything else); `base_only(adapters)` zeroes B, which makes the adapted
model the base again (the KL reference without a second copy of the weights).
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
from flax import nnx

# HF/PEFT names of the projections an adapter can target.
ATTENTION_TARGETS = ("q_proj", "k_proj", "v_proj", "o_proj")
MLP_TARGETS = ("gate_proj", "up_proj", "down_proj")
TARGETS = ATTENTION_TARGETS + MLP_TARGETS


@dataclasses.dataclass(frozen=True)
class LoRAConfig:
    """``rank`` r (0 = no adapters), ``alpha`` (the update is scaled by alpha / r; 0 = r,
    a scale of 1), ``targets``: projection names from ``TARGETS`` (empty = all)."""

    rank: int = 0
    alpha: float = 0.0
    targets: tuple[str, ...] = ()

    def __post_init__(self):
        if not isinstance(self.rank, int) or isinstance(self.rank, bool) or self.rank < 0:
            raise ValueError(f"lora_rank: must be an integer >= 0 (0 = off), got {self.rank!r}")
        if self.alpha < 0:
            raise ValueError(f"lora_alpha: must be >= 0 (0 = lora_rank), got {self.alpha}")
        unknown = [t for t in self.targets if t not in TARGETS]
        if unknown:
            raise ValueError(f"lora_targets: unknown projection {unknown[0]!r}; choose from "
                             f"{', '.join(TARGETS)}")

    @property
    def enabled(self) -> bool:
        return self.rank > 0

    @property
    def scale(self) -> float:
        return (self.alpha or self.rank) / self.rank

    @property
    def target_names(self) -> tuple[str, ...]:
        return tuple(self.targets) or TARGETS


def adapter_count(cfg, config: LoRAConfig) -> int:
    """Values the adapters of ``config`` hold on a model of config ``cfg``: L·r·(in + out)
    per targeted projection."""
    if not config.enabled:
        return 0
    d, f = cfg.hidden_size, cfg.intermediate_size
    q, kv = cfg.num_attention_heads * cfg.head_dim, cfg.num_key_value_heads * cfg.head_dim
    shapes = {"q_proj": (d, q), "k_proj": (d, kv), "v_proj": (d, kv), "o_proj": (q, d),
              "gate_proj": (d, f), "up_proj": (d, f), "down_proj": (f, d)}
    return cfg.num_hidden_layers * config.rank * sum(
        sum(shapes[name]) for name in config.target_names)


def lora_delta(x: jax.Array, proj: nnx.Module) -> jax.Array | None:
    """s·(x·A)·B of projection ``proj`` in float32, or None when it has no adapter. The
    matmuls' inputs are in the projection's compute dtype, as the base's are."""
    lora_a = getattr(proj, "lora_a", None)
    if lora_a is None:
        return None
    dtype = proj.dtype or x.dtype
    a = lora_a[...].astype(dtype)
    b = proj.lora_b[...].astype(dtype)
    low = jnp.dot(x.astype(dtype), a, preferred_element_type=jnp.float32)
    return proj.lora_scale * jnp.dot(low.astype(dtype), b, preferred_element_type=jnp.float32)


def projections(model) -> list[tuple[str, nnx.Module]]:
    """(name, module) of every projection of the stacked decoder block."""
    block = model.layers
    return ([(n, getattr(block.attn, n)) for n in ATTENTION_TARGETS]
            + [(n, getattr(block.mlp, n)) for n in MLP_TARGETS])


def add_lora(model, config: LoRAConfig, seed: int = 0):
    """Adds adapters (A random, B = 0) to ``model``'s targeted projections, in place, and
    returns it. The model computes what it computed before until B moves."""
    if not config.enabled:
        return model
    layers = model.cfg.num_hidden_layers
    key = jax.random.key(seed)
    for i, (name, proj) in enumerate(projections(model)):
        if name not in config.target_names:
            continue
        kernel = proj.kernel[...]  # [L, n_in, n_out]
        n_in, n_out = kernel.shape[-2:]
        dtype = jnp.dtype(proj.param_dtype)
        a = jax.random.normal(jax.random.fold_in(key, i), (layers, n_in, config.rank),
                              jnp.float32) / jnp.sqrt(n_in)
        proj.lora_a = nnx.LoRAParam(a.astype(dtype))
        proj.lora_b = nnx.LoRAParam(jnp.zeros((layers, config.rank, n_out), dtype))
        proj.lora_scale = float(config.scale)
    return model


def has_lora(model) -> bool:
    return any(getattr(p, "lora_a", None) is not None for _, p in projections(model))


def split_trainable(model):
    """(graphdef, adapters, frozen): the adapters as one state, every other variable as
    another; ``nnx.merge(graphdef, adapters, frozen)`` is the model."""
    return nnx.split(model, nnx.LoRAParam, ...)


def combine(adapters, frozen):
    """One state holding both parts (no array is copied)."""
    return nnx.merge_state(frozen, adapters)


def base_only(adapters):
    """``adapters`` with every B set to 0: combined with the frozen base, the base model."""
    def zeroed(path, x):
        return jnp.zeros_like(x) if "lora_b" in jax.tree_util.keystr(path) else x

    return jax.tree_util.tree_map_with_path(zeroed, adapters)


def merge_adapters(model):
    """``model`` with each adapted kernel replaced by W + s·A·B and its adapters removed, in
    place (the dense model a Hugging Face checkpoint holds); returns it."""
    for _, proj in projections(model):
        if getattr(proj, "lora_a", None) is None:
            continue
        delta = proj.lora_scale * jnp.einsum(
            "lir,lro->lio", proj.lora_a[...].astype(jnp.float32),
            proj.lora_b[...].astype(jnp.float32))
        kernel = proj.kernel[...]
        proj.kernel.value = (kernel.astype(jnp.float32) + delta).astype(kernel.dtype)
        del proj.lora_a, proj.lora_b, proj.lora_scale
    return model
