"""Decoder-only transformers (Qwen2/Qwen2.5, Qwen3, Llama 3) and Hugging Face interop.

    model, tokenizer = load_pretrained(path, dtype="float32")
    save_pretrained(model, tokenizer, out_dir)
"""

from jaxrl_agentic.models.config import ModelConfig, UnsupportedModelError
from jaxrl_agentic.models.hf_io import CheckpointError, load_pretrained, save_pretrained
from jaxrl_agentic.models.transformer import KVCache, Transformer

__all__ = [
    "CheckpointError",
    "KVCache",
    "ModelConfig",
    "Transformer",
    "UnsupportedModelError",
    "load_pretrained",
    "save_pretrained",
]
