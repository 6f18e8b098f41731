"""Read a llama.cpp GGUF file as a Hugging Face directory, without torch.

    hf_dir = gguf_model_dir("SmolLM2-135M-Instruct.Q4_1.gguf")   # converted once, cached
    model, tokenizer = load_pretrained("SmolLM2-135M-Instruct.Q4_1.gguf")  # the same, via hf_io

A GGUF file holds the weights (each tensor in its own ggml type: F32/F16/BF16, Q4_0,
Q4_1, Q5_0, Q5_1, Q8_0, the K-quants, the IQ types), the architecture's numbers and the
tokenizer (vocabulary, merges, token types, special ids, chat template) as metadata. It is
read with the `gguf` package (numpy only) and written once into the cache as the directory
`hf_io.load_pretrained` already reads, so every later part of a run (sharded loading,
export, the memory plan) sees an ordinary Hugging Face checkpoint:

- every tensor is dequantised to float32 with `gguf.quants.dequantize` (exact: each
  quantised value is a small integer times an fp16 scale, plus an fp16 offset);
- llama.cpp's converter reorders the rows of Llama's Q and K projections so that its RoPE
  rotates adjacent pairs; `_unpermute` undoes it. For head h, row r of a head of size d:
  stored row h·d + 2i + j  ←  original row h·d + j·d/2 + i  (i < d/2, j ∈ {0, 1});
- the tokenizer is rebuilt with `tokenizers` from the metadata: byte-level BPE
  (`tokenizer.ggml.model == "gpt2"`) with the pre-tokenizer the file names
  (`tokenizer.ggml.pre`), CONTROL tokens (type 3) as special tokens and USER_DEFINED ones
  (type 4) as added tokens, and the file's chat template.

Anything this cannot represent exactly — another architecture, a tokenizer model other than
byte-level BPE, an unknown pre-tokenizer, a tensor type `gguf` cannot dequantise, a tensor
that no parameter uses — is one `GGUFError` line naming the file and the tensor or key.
"""

from __future__ import annotations

import functools
import hashlib
import json
import os
import sys

import numpy as np

from jaxrl_agentic.models.config import ModelConfig, to_hf_config
from jaxrl_agentic.models.files import (
    CheckpointError,
    cache_dir,
    directory_written_whole,
    file_lock,
)

# Bump when the conversion's output changes: a new cache directory, old ones are left alone.
CONVERTER_VERSION = "v2"  # v2: config.json names its model class (`architectures`)
_SHARD_BYTES = 2 << 30  # safetensors shards of at most ~2 GiB (a 7B model is 14 shards)

# GGUF architecture → our model_type, and whether llama.cpp permuted its Q/K rows.
ARCHITECTURES = {"llama": ("llama", True), "qwen2": ("qwen2", False), "qwen3": ("qwen3", False)}

# Tensor names inside a block: GGUF → Hugging Face (after "model.layers.{i}.").
_BLOCK_TENSORS = {
    "attn_norm.weight": "input_layernorm.weight",
    "ffn_norm.weight": "post_attention_layernorm.weight",
    "attn_q.weight": "self_attn.q_proj.weight",
    "attn_k.weight": "self_attn.k_proj.weight",
    "attn_v.weight": "self_attn.v_proj.weight",
    "attn_output.weight": "self_attn.o_proj.weight",
    "attn_q.bias": "self_attn.q_proj.bias",
    "attn_k.bias": "self_attn.k_proj.bias",
    "attn_v.bias": "self_attn.v_proj.bias",
    "attn_q_norm.weight": "self_attn.q_norm.weight",
    "attn_k_norm.weight": "self_attn.k_norm.weight",
    "ffn_gate.weight": "mlp.gate_proj.weight",
    "ffn_up.weight": "mlp.up_proj.weight",
    "ffn_down.weight": "mlp.down_proj.weight",
}
_TOP_TENSORS = {"token_embd.weight": "model.embed_tokens.weight",
                "output_norm.weight": "model.norm.weight", "output.weight": "lm_head.weight"}

# Pre-tokenizers by `tokenizer.ggml.pre` (llama.cpp's names): how text is split into words
# before BPE, as the model's own tokenizer.json does it. SmolLM's splits every digit apart.
_QWEN2_SPLIT = (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}"
                r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+")
_LLAMA3_SPLIT = (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}"
                 r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+")
PRE_TOKENIZERS = ("gpt-2", "default", "smollm", "starcoder", "qwen2", "llama-bpe", "llama3")


class GGUFError(CheckpointError):
    """A GGUF file this package cannot convert exactly."""


def _fields(reader) -> dict:
    out = {}
    for key, field in reader.fields.items():
        try:
            out[key] = field.contents()
        except Exception:  # a value type gguf cannot decode: not one we read
            continue
    return out


def _require(meta: dict, key: str, where: str):
    if key not in meta:
        raise GGUFError(f"{where}: metadata key {key!r} missing")
    return meta[key]


def model_config(meta: dict, where: str) -> tuple[ModelConfig, bool]:
    """(the ModelConfig a GGUF's metadata describes, whether its Q/K rows are permuted)."""
    arch = meta.get("general.architecture")
    if arch not in ARCHITECTURES:
        raise GGUFError(f"{where}: architecture {arch!r} is not supported; "
                        f"supported: {sorted(ARCHITECTURES)}")
    model_type, permuted = ARCHITECTURES[arch]

    def get(key):
        return _require(meta, f"{arch}.{key}", where)

    heads = int(get("attention.head_count"))
    hidden = int(get("embedding_length"))
    head_dim = int(meta.get(f"{arch}.attention.key_length", hidden // heads))
    if meta.get(f"{arch}.rope.scaling.type", "none") not in ("none", None):
        raise GGUFError(f"{where}: rope scaling {meta[f'{arch}.rope.scaling.type']!r} "
                        "is not supported")
    tokens = _require(meta, "tokenizer.ggml.tokens", where)
    cfg = ModelConfig(
        model_type=model_type,
        vocab_size=int(meta.get(f"{arch}.vocab_size", len(tokens))),
        hidden_size=hidden,
        intermediate_size=int(get("feed_forward_length")),
        num_hidden_layers=int(get("block_count")),
        num_attention_heads=heads,
        num_key_value_heads=int(meta.get(f"{arch}.attention.head_count_kv", heads)),
        head_dim=head_dim,
        rms_norm_eps=float(get("attention.layer_norm_rms_epsilon")),
        rope_theta=float(meta.get(f"{arch}.rope.freq_base", 10000.0)),
        max_position_embeddings=int(get("context_length")),
        tie_word_embeddings=True,  # corrected by the caller if the file has output.weight
        attention_bias=model_type == "qwen2",
        qk_norm=model_type == "qwen3",
        bos_token_id=meta.get("tokenizer.ggml.bos_token_id"),
        eos_token_id=meta.get("tokenizer.ggml.eos_token_id"),
    )
    return cfg, permuted


def _unpermute(w: np.ndarray, n_heads: int) -> np.ndarray:
    """Undo llama.cpp's Q/K row order (see the module doc) on [n_heads·d, …] rows."""
    d = w.shape[0] // n_heads
    return w.reshape(n_heads, d // 2, 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def _hf_tensor_name(name: str, where: str) -> str:
    if name in _TOP_TENSORS:
        return _TOP_TENSORS[name]
    parts = name.split(".", 2)
    if len(parts) == 3 and parts[0] == "blk" and parts[1].isdigit() \
            and parts[2] in _BLOCK_TENSORS:
        return f"model.layers.{parts[1]}.{_BLOCK_TENSORS[parts[2]]}"
    raise GGUFError(f"{where}: tensor {name!r} has no counterpart in this architecture")


def dequantized(tensor, where: str) -> np.ndarray:
    """A GGUF tensor as float32 in Hugging Face's [out, in] layout."""
    from gguf import GGMLQuantizationType
    from gguf.quants import dequantize

    qtype = GGMLQuantizationType(tensor.tensor_type)
    try:
        w = dequantize(tensor.data, qtype)
    except NotImplementedError:
        raise GGUFError(f"{where}: tensor {tensor.name!r} has type {qtype.name}, "
                        "which the gguf package cannot dequantise") from None
    shape = tuple(int(n) for n in reversed(tensor.shape))  # ggml lists dims innermost first
    return np.ascontiguousarray(np.asarray(w, np.float32).reshape(shape))


def hf_tensors(reader, cfg: ModelConfig, permuted: bool, where: str):
    """Yields (HF tensor name, float32 array) for every tensor of the file."""
    for tensor in reader.tensors:
        name = _hf_tensor_name(tensor.name, where)
        w = dequantized(tensor, where)
        if permuted and (".attn_q." in tensor.name or ".attn_k." in tensor.name):
            heads = cfg.num_attention_heads if ".attn_q." in tensor.name \
                else cfg.num_key_value_heads
            w = _unpermute(w, heads)
        yield name, w


def _pre_tokenizer(pre: str | None, where: str):
    from tokenizers import Regex, pre_tokenizers

    pre = pre or "default"
    if pre in ("gpt-2", "default"):
        return pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    if pre in ("smollm", "starcoder"):
        return pre_tokenizers.Sequence([
            pre_tokenizers.Digits(individual_digits=True),
            pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)])
    if pre in ("qwen2", "llama-bpe", "llama3"):
        split = _QWEN2_SPLIT if pre == "qwen2" else _LLAMA3_SPLIT
        return pre_tokenizers.Sequence([
            pre_tokenizers.Split(Regex(split), behavior="isolated"),
            pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)])
    raise GGUFError(f"{where}: pre-tokenizer {pre!r} is not supported; "
                    f"supported: {PRE_TOKENIZERS}")


def build_tokenizer(meta: dict, where: str):
    """The file's tokenizer as a `transformers` fast tokenizer (see the module doc)."""
    import transformers
    from tokenizers import AddedToken, Tokenizer, decoders, models

    kind = meta.get("tokenizer.ggml.model")
    if kind != "gpt2":
        raise GGUFError(f"{where}: tokenizer model {kind!r} is not supported (only byte-level "
                        "BPE, 'gpt2')")
    tokens = list(_require(meta, "tokenizer.ggml.tokens", where))
    types = list(meta.get("tokenizer.ggml.token_type") or [1] * len(tokens))
    merges = [tuple(m.split(" ", 1)) for m in _require(meta, "tokenizer.ggml.merges", where)]
    backend = Tokenizer(models.BPE(vocab={t: i for i, t in enumerate(tokens)}, merges=merges,
                                   fuse_unk=False))
    backend.pre_tokenizer = _pre_tokenizer(meta.get("tokenizer.ggml.pre"), where)
    backend.decoder = decoders.ByteLevel()
    backend.add_special_tokens([AddedToken(t, special=True, normalized=False)
                                for t, k in zip(tokens, types, strict=True) if k == 3])
    backend.add_tokens([AddedToken(t, special=False, normalized=False)
                        for t, k in zip(tokens, types, strict=True) if k == 4])

    def token(key):
        i = meta.get(f"tokenizer.ggml.{key}_token_id")
        return tokens[int(i)] if i is not None and 0 <= int(i) < len(tokens) else None

    template = meta.get("tokenizer.chat_template")
    if not template:
        raise GGUFError(f"{where}: metadata key 'tokenizer.chat_template' missing "
                        "(multi-turn rollouts render with the model's own template)")
    tok = transformers.PreTrainedTokenizerFast(
        tokenizer_object=backend, bos_token=token("bos"), eos_token=token("eos"),
        unk_token=token("unknown"), pad_token=token("padding") or token("eos"),
        chat_template=template, clean_up_tokenization_spaces=False,
        add_bos_token=bool(meta.get("tokenizer.ggml.add_bos_token", False)))
    return tok


def _write_shards(tensors, out: str) -> None:
    """safetensors shards of ≤ `_SHARD_BYTES` (an index when there are several), written as
    the tensors arrive so no more than one shard is in memory."""
    from safetensors.numpy import save_file

    shards, current, size = [], {}, 0  # shards: the tensor names of each written shard

    def flush():
        nonlocal current, size
        if current:
            save_file(current, os.path.join(out, f"shard-{len(shards) + 1:05d}.safetensors"),
                      metadata={"format": "pt"})
            shards.append(sorted(current))
            current, size = {}, 0

    for name, w in tensors:
        if size and size + w.nbytes > _SHARD_BYTES:
            flush()
        current[name], size = w, size + w.nbytes
    flush()
    if len(shards) == 1:
        os.replace(os.path.join(out, "shard-00001.safetensors"),
                   os.path.join(out, "model.safetensors"))
        return
    weight_map = {n: f"shard-{i + 1:05d}.safetensors" for i, names in enumerate(shards)
                  for n in names}
    with open(os.path.join(out, "model.safetensors.index.json"), "w") as f:
        json.dump({"metadata": {}, "weight_map": weight_map}, f, indent=1)


def convert_gguf(path: str, out: str) -> str:
    """Writes the GGUF file `path` as a Hugging Face directory `out` (config.json,
    safetensors, tokenizer with its chat template); returns `out`."""
    from gguf import GGUFReader

    where = os.path.abspath(path)
    if not os.path.isfile(path):
        raise GGUFError(f"GGUF file not found: {where}")
    try:
        reader = GGUFReader(path)
    except (ValueError, OSError) as e:
        raise GGUFError(f"{where}: not a readable GGUF file: {e}".splitlines()[0]) from None
    meta = _fields(reader)
    cfg, permuted = model_config(meta, where)
    names = {t.name for t in reader.tensors}
    cfg = cfg.replace(tie_word_embeddings="output.weight" not in names)
    tokenizer = build_tokenizer(meta, where)
    with directory_written_whole(out) as tmp:
        to_hf_config(cfg).save_pretrained(tmp)
        _write_shards(hf_tensors(reader, cfg, permuted, where), tmp)
        tokenizer.save_pretrained(tmp)
        with open(os.path.join(tmp, "gguf_source.json"), "w") as f:
            json.dump({"file": os.path.basename(path), "converter": CONVERTER_VERSION,
                       "name": meta.get("general.name")}, f, indent=1)
    return out


def file_sha256(path: str) -> str:
    """The sha256 of the file at `path`, read once per process for each (size, mtime): a
    run resolves its model several times (the plan, the load, the LoRA checks), and a
    7B GGUF file takes seconds to hash."""
    stat = os.stat(path)
    return _sha256(os.path.abspath(path), stat.st_size, stat.st_mtime_ns)


@functools.lru_cache(maxsize=32)
def _sha256(path: str, size: int, mtime_ns: int) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 22), b""):
            digest.update(block)
    return digest.hexdigest()


def gguf_model_dir(path: str) -> str:
    """The cached Hugging Face directory of a GGUF file, converted on first use (keyed by
    the file's sha256, so an edited file is converted again; safe under concurrent callers)."""
    path = os.path.abspath(os.path.expanduser(str(path)))
    if not os.path.isfile(path):
        raise GGUFError(f"GGUF file not found: {path}")
    stem = os.path.basename(path).removesuffix(".gguf")
    out = os.path.join(cache_dir(), "models",
                       f"gguf-{stem}-{file_sha256(path)[:16]}-{CONVERTER_VERSION}")
    if os.path.exists(os.path.join(out, "config.json")):
        return out
    with file_lock(out + ".lock"):
        if not os.path.exists(os.path.join(out, "config.json")):
            print(f"[jaxrl_agentic] converting {os.path.basename(path)} into {out}",
                  file=sys.stderr)
            convert_gguf(path, out)
    return out
