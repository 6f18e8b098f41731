"""The architectures of a few published checkpoints, for planning without their files.

``known_model_config(name)`` gives the :class:`ModelConfig` a checkpoint's config.json
describes (the fields the forward pass reads, copied from the published config.json files),
so a run's programs can be compiled and its memory planned for a model that is not on
this machine (``compile_tpu``). The name is matched on the last path component, case and
an ``-Instruct`` suffix ignored: ``/models/Qwen2.5-0.5B-Instruct`` is ``qwen2.5-0.5b``.
"""

from __future__ import annotations

import dataclasses
import os

from jaxrl_agentic.models.config import ModelConfig

_QWEN25 = dict(model_type="qwen2", rms_norm_eps=1e-6, rope_theta=1_000_000.0,
               max_position_embeddings=32_768, attention_bias=True, bos_token_id=151_643,
               eos_token_id=151_645)
# config.json fields: hidden_size, intermediate_size, num_hidden_layers,
# num_attention_heads, num_key_value_heads, vocab_size, tie_word_embeddings.
KNOWN_SHAPES: dict[str, dict] = {
    "qwen2.5-0.5b": dict(_QWEN25, hidden_size=896, intermediate_size=4864,
                         num_hidden_layers=24, num_attention_heads=14, num_key_value_heads=2,
                         vocab_size=151_936, tie_word_embeddings=True),
    "qwen2.5-1.5b": dict(_QWEN25, hidden_size=1536, intermediate_size=8960,
                         num_hidden_layers=28, num_attention_heads=12, num_key_value_heads=2,
                         vocab_size=151_936, tie_word_embeddings=True),
    "qwen2.5-3b": dict(_QWEN25, hidden_size=2048, intermediate_size=11_008,
                       num_hidden_layers=36, num_attention_heads=16, num_key_value_heads=2,
                       vocab_size=151_936, tie_word_embeddings=True),
    "qwen2.5-7b": dict(_QWEN25, hidden_size=3584, intermediate_size=18_944,
                       num_hidden_layers=28, num_attention_heads=28, num_key_value_heads=4,
                       vocab_size=152_064, tie_word_embeddings=False),
    "smollm2-135m": dict(model_type="llama", hidden_size=576, intermediate_size=1536,
                         num_hidden_layers=30, num_attention_heads=9, num_key_value_heads=3,
                         vocab_size=49_152, tie_word_embeddings=True, rms_norm_eps=1e-5,
                         rope_theta=100_000.0, max_position_embeddings=8192,
                         attention_bias=False, bos_token_id=1, eos_token_id=2),
}


def shape_name(source: str) -> str:
    """The table key a model source would match: its last path component, lower case,
    without ``-instruct`` or a file extension."""
    name = os.path.basename(os.path.normpath(str(source))).lower()
    for suffix in (".gguf", "-instruct"):
        name = name.removesuffix(suffix)
    return name


def known_model_config(source: str, dtype: str = "float32", param_dtype: str | None = None,
                       untie_word_embeddings: bool = False) -> ModelConfig | None:
    """The config of a checkpoint in :data:`KNOWN_SHAPES` (None for another name), as
    ``hf_io.read_model_config`` with the same arguments would read it."""
    fields = KNOWN_SHAPES.get(shape_name(source))
    if fields is None:
        return None
    fields = dict(fields)
    fields["head_dim"] = fields["hidden_size"] // fields["num_attention_heads"]
    cfg = ModelConfig(**fields, dtype=dtype, param_dtype=param_dtype or dtype)
    if untie_word_embeddings and cfg.tie_word_embeddings:
        cfg = dataclasses.replace(cfg, tie_word_embeddings=False)
    return cfg


__all__ = ["KNOWN_SHAPES", "known_model_config", "shape_name"]
