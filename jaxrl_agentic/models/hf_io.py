"""Load and save Hugging Face checkpoint directories (config.json + safetensors + tokenizer).

Only local files are read (no hub access, no remote code) and weights only from
safetensors, never pickle. Every failure is one `CheckpointError` line naming the file and key.
"""

from __future__ import annotations

import dataclasses
import functools
import json
import os

import jax
import jax.numpy as jnp
from flax import nnx

from jaxrl_agentic.models import lora
from jaxrl_agentic.models.config import (
    ModelConfig,
    UnsupportedModelError,
    from_hf_config,
    to_hf_config,
)
from jaxrl_agentic.models.files import CheckpointError, directory_written_whole
from jaxrl_agentic.models.sources import hf_directory
from jaxrl_agentic.models.transformer import Transformer

_TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "vocab.json", "tokenizer.model")


def _hf_names(path: tuple, num_layers: int) -> tuple[list[str], bool, bool]:
    """Our parameter path → (HF tensor names, stored transposed, stacked).

    A decoder-block parameter is stored stacked ([L, ...], ``Transformer.layers``): it is
    the L tensors ``model.layers.{i}....`` of the checkpoint, one per layer."""
    if path == ("embed", "embedding"):
        return ["model.embed_tokens.weight"], False, False
    if path == ("final_norm", "scale"):
        return ["model.norm.weight"], False, False
    if path == ("lm_head", "kernel"):
        return ["lm_head.weight"], True, False
    _, part, *rest = path
    if part == "input_norm":
        name, transposed = "input_layernorm.weight", False
    elif part == "post_attn_norm":
        name, transposed = "post_attention_layernorm.weight", False
    else:
        module = "self_attn" if part == "attn" else "mlp"
        if rest[-1] == "scale":  # q_norm / k_norm
            name, transposed = f"{module}.{rest[0]}.weight", False
        else:
            leaf = "weight" if rest[-1] == "kernel" else "bias"
            name, transposed = f"{module}.{rest[0]}.{leaf}", leaf == "weight"
    return [f"model.layers.{i}.{name}" for i in range(num_layers)], transposed, True


def _flatten(tree, prefix=()):
    for key, value in tree.items():
        if isinstance(value, dict):
            yield from _flatten(value, prefix + (key,))
        else:
            yield prefix + (key,), value


def _set_path(tree: dict, path: tuple, value) -> None:
    for key in path[:-1]:
        tree = tree.setdefault(key, {})
    tree[path[-1]] = value


def _weight_files(path: str) -> dict[str, str]:
    """HF tensor name → safetensors file holding it (single file or sharded index)."""
    index = os.path.join(path, "model.safetensors.index.json")
    single = os.path.join(path, "model.safetensors")
    if os.path.exists(index):
        with open(index) as f:
            weight_map = json.load(f).get("weight_map")
        if not isinstance(weight_map, dict):
            raise CheckpointError(f"{index}: no 'weight_map' object")
        return {name: os.path.join(path, file) for name, file in weight_map.items()}
    if os.path.exists(single):
        from safetensors import safe_open

        with safe_open(single, framework="flax") as f:
            return {name: single for name in f.keys()}
    if any(n.endswith(".bin") for n in os.listdir(path)):
        raise CheckpointError(
            f"{path}: only pickle (.bin) weights found; convert them to safetensors first"
        )
    raise CheckpointError(f"{path}: no model.safetensors or model.safetensors.index.json")


def _read_config(path: str, dtype: str, param_dtype: str | None) -> ModelConfig:
    import transformers

    if not os.path.isdir(path):
        raise CheckpointError(f"model directory not found: {path}")
    config_file = os.path.join(path, "config.json")
    if not os.path.exists(config_file):
        raise CheckpointError(f"{config_file}: missing (not a Hugging Face model directory)")
    with open(config_file) as f:
        model_type = json.load(f).get("model_type")
    try:
        hf_config = transformers.AutoConfig.from_pretrained(
            path, local_files_only=True, trust_remote_code=False
        )
    except (ValueError, KeyError, OSError) as e:
        raise CheckpointError(
            f"{config_file}: cannot read config (model_type {model_type!r}): {e}".splitlines()[0]
        ) from None
    try:
        return from_hf_config(hf_config, dtype=dtype, param_dtype=param_dtype)
    except UnsupportedModelError as e:
        raise CheckpointError(f"{config_file}: {e}") from None


def _untied(cfg: ModelConfig, untie_word_embeddings: bool) -> tuple[ModelConfig, bool]:
    """(the config the model is loaded with, whether loading unties a tied head)."""
    untie = untie_word_embeddings and cfg.tie_word_embeddings
    return (dataclasses.replace(cfg, tie_word_embeddings=False) if untie else cfg), untie


def read_model_config(path: str, dtype: str = "float32", param_dtype: str | None = None,
                      untie_word_embeddings: bool = False) -> ModelConfig:
    """The ModelConfig of an HF directory (its config.json), without reading any weight:
    the one ``load_pretrained`` with the same arguments builds the model from."""
    return _untied(_read_config(path, dtype, param_dtype), untie_word_embeddings)[0]


def load_tokenizer(path: str):
    import transformers

    if not any(os.path.exists(os.path.join(path, n)) for n in _TOKENIZER_FILES):
        raise CheckpointError(
            f"{path}: no tokenizer files (expected one of {', '.join(_TOKENIZER_FILES)})"
        )
    try:
        return transformers.AutoTokenizer.from_pretrained(
            path, local_files_only=True, trust_remote_code=False
        )
    except (ValueError, OSError) as e:
        raise CheckpointError(f"{path}: cannot load tokenizer: {e}".splitlines()[0]) from None


def load_params(path: str, cfg: ModelConfig, shardings=None, untied_from_tied: bool = False):
    """(graphdef, params state) with the checkpoint's tensors, cast to cfg.param_dtype.

    ``untied_from_tied``: ``cfg`` is the untied version of a tied checkpoint's config; the
    output head (absent from the file) is read from the embedding.

    ``shardings``: optional ``(path names, shape) -> jax.sharding.Sharding``. Each parameter
    is then built shard by shard (``make_array_from_callback``) from slices read out of the
    safetensors file, so no process ever holds a whole-model copy.
    """
    from safetensors import safe_open

    abstract = nnx.eval_shape(lambda: Transformer(cfg, rngs=nnx.Rngs(0)))
    graphdef, abstract_state = nnx.split(abstract)
    files = _weight_files(path)
    handles: dict[str, object] = {}
    pure: dict = {}
    used = set()

    def open_tensor(name: str):
        if name not in files:
            where = os.path.join(path, "model.safetensors[.index.json]")
            raise CheckpointError(f"{where}: missing tensor {name!r}")
        file = files[name]
        if file not in handles:
            if not os.path.exists(file):
                raise CheckpointError(f"{file}: shard listed in the index is missing")
            handles[file] = safe_open(file, framework="flax").__enter__()
        return file, handles[file]

    try:
        for p, leaf in _flatten(nnx.to_pure_dict(abstract_state)):
            names, transposed, stacked = _hf_names(p, cfg.num_hidden_layers)
            if names == ["lm_head.weight"] and names[0] not in files and untied_from_tied:
                # Untied on load: the head starts as the embedding it was tied to ([V, D]
                # stored, read transposed into the [D, V] kernel), so the outputs do not change.
                names = ["model.embed_tokens.weight"]
            used.update(names)
            expected = tuple(leaf.shape[1:] if stacked else leaf.shape)
            slices, whole = [], []
            for name in names:
                file, handle = open_tensor(name)
                stored = handle.get_slice(name)
                shape = tuple(stored.get_shape())
                shape = shape[::-1] if transposed else shape
                if shape != expected:
                    raise CheckpointError(
                        f"{file}: tensor {name!r} has shape {shape}, "
                        f"expected {expected} for this config"
                    )
                slices.append(stored)
                whole.append(functools.partial(handle.get_tensor, name))
            if shardings is None:
                tensors = [read() for read in whole]
                tensors = [t.T if transposed else t for t in tensors]
                tensor = jnp.stack(tensors) if stacked else tensors[0]
                _set_path(pure, p, jnp.asarray(tensor, dtype=leaf.dtype))
            else:
                shape = tuple(leaf.shape)
                read = functools.partial(_read_slice, slices, transposed, stacked, leaf.dtype)
                _set_path(pure, p, jax.make_array_from_callback(shape, shardings(p, shape), read))
    finally:
        for h in handles.values():
            h.__exit__(None, None, None)
    # A tensor this architecture does not use means the config and weights disagree; loading
    # anyway would silently drop it. (Tied checkpoints may still carry lm_head.weight.)
    ignorable = {"lm_head.weight"} if cfg.tie_word_embeddings else set()
    unused = sorted(n for n in files if n not in used and n not in ignorable
                    and not n.endswith("rotary_emb.inv_freq"))
    if unused:
        raise CheckpointError(
            f"{files[unused[0]]}: unexpected tensor {unused[0]!r} ({len(unused)} unused in all); "
            "the config does not describe these weights"
        )
    nnx.replace_by_pure_dict(abstract_state, pure)
    return graphdef, abstract_state


def _read_slice(slices, transposed: bool, stacked: bool, dtype, index: tuple) -> jax.Array:
    """One shard's block of a parameter from its stored tensors (HF keeps linear weights as
    [out, in]; a stacked parameter's first index picks layers, one stored tensor each)."""
    def block(stored, index):
        return stored[index[::-1]].T if transposed else stored[index]

    if stacked:
        layers = range(len(slices))[index[0]]
        out = jnp.stack([jnp.asarray(block(slices[i], index[1:])) for i in layers])
    else:
        out = block(slices[0], index)
    return jnp.asarray(out, dtype=dtype)


def load_pretrained(path: str, dtype: str = "float32", param_dtype: str | None = None,
                    shardings=None, untie_word_embeddings: bool = False):
    """Reads a local HF directory, a ``.gguf`` file or a packaged model's name
    (``models/sources.py``) → (Transformer, tokenizer).

    `dtype` is the compute dtype; parameters are stored in `param_dtype` (default: dtype).
    `shardings` places each parameter straight into its shards (see `load_params`).
    `untie_word_embeddings`: a tied checkpoint gets its own output head, a copy of the
    embedding (same outputs at load; trained apart from then on, saved untied). Why a run
    may want it: `docs/algorithms.md` ("Tied embeddings and generated format tokens").
    """
    path = hf_directory(path)
    cfg, untie = _untied(_read_config(path, dtype, param_dtype), untie_word_embeddings)
    tokenizer = load_tokenizer(path)
    graphdef, state = load_params(path, cfg, shardings, untied_from_tied=untie)
    return nnx.merge(graphdef, state), tokenizer


def save_pretrained(model: Transformer, tokenizer, path: str) -> None:
    """Writes config.json, model.safetensors and the tokenizer so `transformers` loads it.

    The directory is assembled beside its target and renamed into place, so a crash never
    leaves a half-written checkpoint under `path`.
    """
    from safetensors.flax import save_file  # handles bfloat16, which numpy cannot

    with directory_written_whole(path) as tmp:
        to_hf_config(model.cfg).save_pretrained(tmp)
        state = nnx.state(model, nnx.Param)
        tensors = {}
        for p, value in _flatten(nnx.to_pure_dict(state)):
            names, transposed, stacked = _hf_names(p, model.cfg.num_hidden_layers)
            value = jax.device_get(value)
            for name, v in zip(names, value if stacked else [value], strict=True):
                tensors[name] = jnp.asarray(v.T if transposed else v)
        save_file(tensors, os.path.join(tmp, "model.safetensors"), metadata={"format": "pt"})
        if tokenizer is not None:
            tokenizer.save_pretrained(tmp)


def save_peft_adapter(model, path: str, base_model_name_or_path: str = "") -> None:
    """Writes ``model``'s adapters as a PEFT LoRA directory (``adapter_config.json`` and
    ``adapter_model.safetensors``) that ``peft.PeftModel.from_pretrained`` loads onto the
    base: per layer ``l`` and projection, ``lora_A.weight`` = A_lᵀ [r, in] and
    ``lora_B.weight`` = B_lᵀ [out, r], with ``lora_alpha`` = s·r; a head trained beside
    them (``lora.trained_in_full``) as PEFT's ``modules_to_save=["lm_head"]`` (its whole
    [V, D] weight), a trained embedding as ``"embed_tokens"``. Written beside ``path`` and
    renamed into place, so a crash leaves no half-written directory."""
    import numpy as np
    from safetensors.numpy import save_file

    tensors, targets, rank, scale = {}, [], None, None
    for name, proj in lora.projections(model):
        if getattr(proj, "lora_a", None) is None:
            continue
        part = "self_attn" if name in lora.ATTENTION_TARGETS else "mlp"
        a = np.asarray(jax.device_get(proj.lora_a[...]), np.float32)
        b = np.asarray(jax.device_get(proj.lora_b[...]), np.float32)
        rank, scale = a.shape[-1], proj.lora_scale
        targets.append(name)
        for layer in range(a.shape[0]):
            prefix = f"base_model.model.model.layers.{layer}.{part}.{name}"
            tensors[f"{prefix}.lora_A.weight"] = np.ascontiguousarray(a[layer].T)
            tensors[f"{prefix}.lora_B.weight"] = np.ascontiguousarray(b[layer].T)
    if not targets:
        raise ValueError("the model has no LoRA adapters to save (lora_rank = 0)")
    saved = []
    for module, name in lora.trained_in_full(model):  # whole, under their HF names
        (hf_name,), transposed, _ = _hf_names((module, name), 0)
        value = np.asarray(jax.device_get(getattr(getattr(model, module), name)[...]),
                           np.float32)
        tensors[f"base_model.model.{hf_name}"] = np.ascontiguousarray(
            value.T if transposed else value)
        saved.append(hf_name.split(".")[-2])  # lm_head, embed_tokens
    config = {"peft_type": "LORA", "task_type": "CAUSAL_LM", "r": int(rank),
              "lora_alpha": float(scale * rank), "target_modules": targets,
              "modules_to_save": saved or None,
              "lora_dropout": 0.0, "bias": "none", "fan_in_fan_out": False,
              "inference_mode": True, "base_model_name_or_path": base_model_name_or_path}
    with directory_written_whole(path) as tmp:
        save_file(tensors, os.path.join(tmp, "adapter_model.safetensors"),
                  metadata={"format": "pt"})
        with open(os.path.join(tmp, "adapter_config.json"), "w") as f:
            json.dump(config, f, indent=2)
