"""Architecture description shared by the Qwen2/Qwen2.5, Qwen3 and Llama 3 families.

One frozen dataclass holds every number the forward pass needs; `from_hf_config` and
`to_hf_config` translate to and from `transformers` configs so checkpoints round-trip.
"""

from __future__ import annotations

import dataclasses
from typing import Any

SUPPORTED_MODEL_TYPES = ("qwen2", "qwen3", "llama")
SUPPORTED_ROPE_TYPES = ("default", "linear", "llama3", "yarn")
DTYPES = ("float32", "bfloat16", "float16")


class UnsupportedModelError(ValueError):
    """The checkpoint describes an architecture this package does not implement."""


@dataclasses.dataclass(frozen=True)
class ModelConfig:
    model_type: str = "qwen2"
    vocab_size: int = 512
    hidden_size: int = 64
    intermediate_size: int = 128
    num_hidden_layers: int = 2
    num_attention_heads: int = 4
    num_key_value_heads: int = 2
    head_dim: int = 16
    rms_norm_eps: float = 1e-6
    rope_theta: float = 10000.0
    # HF `rope_parameters` minus rope_theta, e.g. {"rope_type": "llama3", "factor": 8.0, ...}.
    rope_scaling: tuple[tuple[str, Any], ...] = ()
    max_position_embeddings: int = 2048
    tie_word_embeddings: bool = True
    attention_bias: bool = True  # bias on q/k/v projections (always on in Qwen2)
    qk_norm: bool = False  # Qwen3: RMSNorm over each head of q and k before RoPE
    mlp_bias: bool = False
    bos_token_id: int | None = None
    eos_token_id: int | None = None
    param_dtype: str = "float32"
    dtype: str = "float32"  # compute dtype of matmuls; norms, softmax and logits stay fp32

    def __post_init__(self):
        if self.model_type not in SUPPORTED_MODEL_TYPES:
            raise UnsupportedModelError(
                f"model_type {self.model_type!r} is not supported; "
                f"supported: {SUPPORTED_MODEL_TYPES}"
            )
        if self.rope_type not in SUPPORTED_ROPE_TYPES:
            raise UnsupportedModelError(
                f"rope_type {self.rope_type!r} is not supported; supported: {SUPPORTED_ROPE_TYPES}"
            )
        if self.num_attention_heads % self.num_key_value_heads:
            raise ValueError(
                f"num_attention_heads ({self.num_attention_heads}) must be a multiple of "
                f"num_key_value_heads ({self.num_key_value_heads})"
            )
        for field in ("param_dtype", "dtype"):
            if getattr(self, field) not in DTYPES:
                raise ValueError(f"{field} must be one of {DTYPES}, got {getattr(self, field)!r}")

    @property
    def rope_type(self) -> str:
        return dict(self.rope_scaling).get("rope_type", "default")

    @property
    def rope_params(self) -> dict[str, Any]:
        return dict(self.rope_scaling)

    def replace(self, **changes) -> ModelConfig:
        return dataclasses.replace(self, **changes)

    def num_params(self) -> int:
        """Parameter count (embeddings counted once when tied)."""
        d, f, v = self.hidden_size, self.intermediate_size, self.vocab_size
        q = self.num_attention_heads * self.head_dim
        kv = self.num_key_value_heads * self.head_dim
        attn = d * q + 2 * d * kv + q * d + (q + 2 * kv if self.attention_bias else 0)
        attn += d if self.attention_bias and self.model_type != "qwen2" else 0
        attn += 2 * self.head_dim if self.qk_norm else 0
        mlp = 3 * d * f + (2 * f + d if self.mlp_bias else 0)
        per_layer = attn + mlp + 2 * d
        head = 0 if self.tie_word_embeddings else v * d
        return v * d + self.num_hidden_layers * per_layer + d + head


def _rope_from_hf(hf: Any) -> tuple[float, tuple[tuple[str, Any], ...]]:
    # transformers >= 5 keeps everything in `rope_parameters`; 4.x used rope_theta + rope_scaling.
    params = dict(getattr(hf, "rope_parameters", None) or {})
    legacy = getattr(hf, "rope_scaling", None)
    if legacy:
        params.update(legacy)
    theta = float(params.pop("rope_theta", getattr(hf, "rope_theta", 10000.0)))
    if "type" in params and "rope_type" not in params:
        params["rope_type"] = params.pop("type")
    params.setdefault("rope_type", "default")
    if params["rope_type"] == "default":
        params = {"rope_type": "default"}
    return theta, tuple(sorted(params.items()))


def from_hf_config(
    hf: Any, *, dtype: str = "float32", param_dtype: str | None = None
) -> ModelConfig:
    """Builds a ModelConfig from a `transformers` PretrainedConfig (qwen2, qwen3, llama)."""
    model_type = getattr(hf, "model_type", None)
    if model_type not in SUPPORTED_MODEL_TYPES:
        raise UnsupportedModelError(
            f"model_type {model_type!r} is not supported; supported: {SUPPORTED_MODEL_TYPES}"
        )
    if model_type == "qwen2" and getattr(hf, "use_sliding_window", False):
        raise UnsupportedModelError("qwen2 with use_sliding_window=True is not supported")
    theta, rope_scaling = _rope_from_hf(hf)
    heads = hf.num_attention_heads
    head_dim = getattr(hf, "head_dim", None) or hf.hidden_size // heads
    eos = hf.eos_token_id[0] if isinstance(hf.eos_token_id, list) else hf.eos_token_id
    return ModelConfig(
        model_type=model_type,
        vocab_size=hf.vocab_size,
        hidden_size=hf.hidden_size,
        intermediate_size=hf.intermediate_size,
        num_hidden_layers=hf.num_hidden_layers,
        num_attention_heads=heads,
        num_key_value_heads=getattr(hf, "num_key_value_heads", None) or heads,
        head_dim=head_dim,
        rms_norm_eps=hf.rms_norm_eps,
        rope_theta=theta,
        rope_scaling=rope_scaling,
        max_position_embeddings=hf.max_position_embeddings,
        tie_word_embeddings=bool(getattr(hf, "tie_word_embeddings", False)),
        attention_bias=model_type == "qwen2" or bool(getattr(hf, "attention_bias", False)),
        qk_norm=model_type == "qwen3",
        mlp_bias=bool(getattr(hf, "mlp_bias", False)),
        bos_token_id=hf.bos_token_id,
        eos_token_id=eos,
        dtype=dtype,
        param_dtype=param_dtype or dtype,
    )


_CAUSAL_LM_CLASSES = {"llama": "LlamaForCausalLM", "qwen2": "Qwen2ForCausalLM",
                      "qwen3": "Qwen3ForCausalLM"}


def to_hf_config(cfg: ModelConfig) -> Any:
    """The `transformers` config that describes the same architecture, with the model class
    in ``architectures`` as a checkpoint's own config.json has it (tools that pick the class
    from there, TRL's ``GRPOTrainer(model=<dir>)`` and vLLM among them, refuse a directory
    without it)."""
    import transformers

    rope = {"rope_theta": cfg.rope_theta, **cfg.rope_params}
    common = dict(
        vocab_size=cfg.vocab_size,
        hidden_size=cfg.hidden_size,
        intermediate_size=cfg.intermediate_size,
        num_hidden_layers=cfg.num_hidden_layers,
        num_attention_heads=cfg.num_attention_heads,
        num_key_value_heads=cfg.num_key_value_heads,
        rms_norm_eps=cfg.rms_norm_eps,
        max_position_embeddings=cfg.max_position_embeddings,
        tie_word_embeddings=cfg.tie_word_embeddings,
        bos_token_id=cfg.bos_token_id,
        eos_token_id=cfg.eos_token_id,
        rope_parameters=rope,
        torch_dtype=cfg.param_dtype,
        architectures=[_CAUSAL_LM_CLASSES[cfg.model_type]],
    )
    if cfg.model_type == "qwen2":
        if cfg.head_dim * cfg.num_attention_heads != cfg.hidden_size:
            raise UnsupportedModelError(
                "qwen2 requires head_dim * num_attention_heads == hidden_size"
            )
        return transformers.Qwen2Config(**common)
    if cfg.model_type == "qwen3":
        return transformers.Qwen3Config(
            head_dim=cfg.head_dim, attention_bias=cfg.attention_bias, **common
        )
    return transformers.LlamaConfig(
        head_dim=cfg.head_dim, attention_bias=cfg.attention_bias, mlp_bias=cfg.mlp_bias, **common
    )
