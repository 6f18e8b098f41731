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
holds fixed (everything else); `base_only(adapters, frozen)` zeroes B, which makes the
adapted model the base again (the KL reference without a second copy of the weights).

The output head can train in full beside the adapters (`train_head`; PEFT's
`modules_to_save=["lm_head"]`): a small model whose task is a choice among a few tokens
learns that choice through its head, and a frozen head left LoRA at about 0.5 eval success
on FrozenLake where full training reaches 0.8 (docs/benchmarks.md). Only an untied head can
(`untie_word_embeddings` unties a tied one as a copy of the embedding); its starting value is
kept frozen beside it (`BaseHead`, [D, V]: the one weight LoRA then holds twice) so the KL
reference stays the base.

The token embedding can train in full too (`train_embedding`; PEFT's
`modules_to_save=["embed_tokens"]`), its start kept frozen beside it (`BaseEmbedding`) for
the same reason. On the tiny recipes it is what LoRA lacks against full training: a model
that reads a map or a problem from a few hundred tokens learns new token features through
its embedding, and the adapters alone (rank 16 at width 128) got there on some seeds only
(docs/benchmarks.md, "LoRA rank 16").

LoRA+ (the B adapters at a larger LR than the A adapters, ``loraplus_lr_ratio``) is an
optimizer setting: ``training/update.py``.
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


HEAD_CHOICES = ("auto", "always", "never")


class BaseHead(nnx.Variable):
    """The output head's starting value, frozen, when the head trains (module docstring):
    not a `Param`, so no checkpoint or export holds it."""


class BaseEmbedding(nnx.Variable):
    """The token embedding's starting value, frozen, when the embedding trains (module
    docstring); like `BaseHead`, never checkpointed or exported."""


# What can train in full beside the adapters: module -> (its variable, the class of the frozen
# start kept as base_<variable>, what a tied model is told).
IN_FULL = {"lm_head": ("kernel", BaseHead, "head is tied to the embedding"),
           "embed": ("embedding", BaseEmbedding, "embedding is tied to the head")}


@dataclasses.dataclass(frozen=True)
class LoRAConfig:
    """``rank`` r (0 = no adapters), ``alpha`` (the update is scaled by alpha / r; 0 = r,
    a scale of 1), ``targets``: projection names from ``TARGETS`` (empty = all),
    ``train_head``: whether the output head trains in full beside the adapters: "always"
    (the head must be untied), "never", or "auto" = when ``untie_word_embeddings`` made
    the head a copy of a tied embedding (``untied_head``: what loading did, from the
    checkpoint's config, ``run_config.loading_unties_head``; not for a checkpoint's own
    untied head); ``train_embedding``: whether the token embedding trains in full beside
    the adapters (a tied head, the same array, then trains with it)."""

    rank: int = 0
    alpha: float = 0.0
    targets: tuple[str, ...] = ()
    train_head: str = "auto"
    untied_head: bool = False
    train_embedding: bool = False

    def __post_init__(self):
        if not isinstance(self.rank, int) or isinstance(self.rank, bool) or self.rank < 0:
            raise ValueError(f"lora_rank: must be an integer >= 0 (0 = off), got {self.rank!r}")
        if self.alpha < 0:
            raise ValueError(f"lora_alpha: must be >= 0 (0 = lora_rank), got {self.alpha}")
        unknown = [t for t in self.targets if t not in TARGETS]
        if unknown:
            raise ValueError(f"lora_targets: unknown projection {unknown[0]!r}; choose from "
                             f"{', '.join(TARGETS)}")
        if self.train_head not in HEAD_CHOICES:
            raise ValueError(f"lora_train_head: must be one of {', '.join(HEAD_CHOICES)}, "
                             f"got {self.train_head!r}")

    @property
    def trains_head(self) -> bool:
        return self.enabled and (self.train_head == "always"
                                 or (self.train_head == "auto" and self.untied_head))

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
    head = cfg.hidden_size * cfg.vocab_size if config.trains_head else 0
    embedding = cfg.hidden_size * cfg.vocab_size if config.train_embedding else 0
    return head + embedding + cfg.num_hidden_layers * config.rank * sum(
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
    # A tied head is the embedding's array: either must be untied to train in full (and a
    # PEFT module_to_save of the embedding would copy it and leave the head behind).
    if config.trains_head:
        _train_in_full(model, "lm_head", "lora_train_head")
    if config.train_embedding:
        _train_in_full(model, "embed", "lora_train_embedding")
    return model


def _train_in_full(model, module: str, field: str) -> None:
    """Makes ``model.<module>``'s variable (``IN_FULL``) trained beside the adapters (a
    `LoRAParam`), its start kept frozen as ``base_<variable>`` (the KL reference's value)."""
    name, base, tied = IN_FULL[module]
    if model.cfg.tie_word_embeddings:
        raise ValueError(f"{field}: the {tied}; untie it (untie_word_embeddings=True) to "
                         f"train it with LoRA")
    part = getattr(model, module)
    value = getattr(part, name)[...]
    setattr(part, f"base_{name}", base(jnp.copy(value)))
    setattr(part, name, nnx.LoRAParam(value))


def trained_in_full(model) -> list[tuple[str, str]]:
    """(module, variable) of each part of ``model`` that trains in full beside the
    adapters, in ``IN_FULL``'s order."""
    return [(module, name) for module, (name, _, _) in IN_FULL.items()
            if getattr(getattr(model, module, None), f"base_{name}", None) is not None]


def has_lora(model) -> bool:
    return any(getattr(p, "lora_a", None) is not None for _, p in projections(model))


def split_trainable(model):
    """(graphdef, adapters, frozen): the adapters as one state, every other variable as
    another; ``nnx.merge(graphdef, adapters, frozen)`` is the model."""
    return nnx.split(model, nnx.LoRAParam, ...)


def combine(adapters, frozen):
    """One state holding both parts (no array is copied)."""
    return nnx.merge_state(frozen, adapters)


def base_only(adapters, frozen):
    """``adapters`` with every B set to 0 and a trained head or embedding back at its start
    (the frozen ``BaseHead`` / ``BaseEmbedding``): combined with ``frozen``, the base
    model."""
    starts = {}
    for module, (name, _, _) in IN_FULL.items():
        part = frozen.get(module, {}) if frozen is not None else {}
        if f"base_{name}" in part:
            starts[f"['{module}']['{name}']"] = jax.tree.leaves(part[f"base_{name}"])[0]

    def based(path, x):
        name = jax.tree_util.keystr(path)
        if "lora_b" in name:
            return jnp.zeros_like(x)
        for key, value in starts.items():
            if key in name:
                return value
        return x

    return jax.tree_util.tree_map_with_path(based, adapters)


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
        proj.kernel.set_value((kernel.astype(jnp.float32) + delta).astype(kernel.dtype))
        del proj.lora_a, proj.lora_b, proj.lora_scale
    # A trained head or embedding is the model's; its start goes.
    for module, name in trained_in_full(model):
        part = getattr(model, module)
        setattr(part, name, nnx.Param(getattr(part, name)[...]))
        delattr(part, f"base_{name}")
    return model
