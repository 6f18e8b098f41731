"""The tiny default model, built locally: nothing can be downloaded on the machines we run on.

    python -m jaxrl_agentic.models.tiny --out DIR [--seed N]

trains a byte-level BPE tokenizer on text that the project's own environments produce
(instructions, rendered grids, action names, `<think>`/`<answer>` replies), gives it a
Qwen-style chat template, and writes a small randomly initialised Qwen2-architecture model
in Hugging Face format. The same seed gives the same files. `default_tiny_model_dir()`
builds it once into the user cache dir and reuses it afterwards.
"""

from __future__ import annotations

import argparse
import contextlib
import fcntl
import os
import random
import shutil
import sys
import tempfile

from jaxrl_agentic.models.config import ModelConfig

# v2: the corpus also has spaced grids (`cell_separator=" "`) and FrozenLake `hints`.
# v3: tool tags as added tokens (ids 516-519) and a chat template with tools and the `tool`
# role; the corpus, the BPE merges, the weights and every chat without tools are those of v2
# (tests/models/test_tiny.py). A new cache directory because the tokenizer files changed.
TINY_VERSION = "v3"
# Without tools and tool messages this renders exactly as v2's template did:
#     <|im_start|>{role}\n{content}<|im_end|>\n ... [<|im_start|>assistant\n]
# With `tools`, a system turn (the caller's system message first, if any) lists their JSON
# schemas in <tools></tools> and shows the call format; `tool` messages are rendered as
# Qwen2.5's template does: consecutive ones share one user turn, each in <tool_response>.
CHAT_TEMPLATE = (
    "{% if tools %}"
    "{{ '<|im_start|>system\\n' }}"
    "{% if messages[0]['role'] == 'system' %}{{ messages[0]['content'] + '\\n\\n' }}{% endif %}"
    "{{ '# Tools\\n\\nYou may call functions. Their signatures are in <tools></tools>:\\n"
    "<tools>' }}"
    "{% for tool in tools %}{{ '\\n' + (tool | tojson) }}{% endfor %}"
    "{{ '\\n</tools>\\n\\nCall one with <tool_call>{\"name\": <function-name>, "
    "\"arguments\": <args-json-object>}</tool_call>.<|im_end|>\\n' }}"
    "{% endif %}"
    "{% for message in messages %}"
    "{% if message['role'] == 'tool' %}"
    "{% if loop.first or messages[loop.index0 - 1]['role'] != 'tool' %}"
    "{{ '<|im_start|>user' }}{% endif %}"
    "{{ '\\n<tool_response>\\n' + message['content'] + '\\n</tool_response>' }}"
    "{% if loop.last or messages[loop.index0 + 1]['role'] != 'tool' %}"
    "{{ '<|im_end|>\\n' }}{% endif %}"
    "{% elif not (tools and loop.first and message['role'] == 'system') %}"
    "{{ '<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>' + '\\n' }}"
    "{% endif %}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}"
)
SPECIAL_TOKENS = ("<|endoftext|>", "<|im_start|>", "<|im_end|>")
# Reply-format tags get a token each (not "special": decoding must keep them).
FORMAT_TOKENS = ("<think>", "</think>", "<answer>", "</answer>")
# Tool tags (v3), added after the format tokens so that every earlier id stays the same;
# the model's 576-row embedding table had room for them (ids 516-519).
TOOL_TOKENS = ("<tool_call>", "</tool_call>", "<tool_response>", "</tool_response>")


def tiny_model_config(vocab_size: int, **overrides) -> ModelConfig:
    base = dict(
        model_type="qwen2",
        vocab_size=vocab_size,
        hidden_size=128,
        intermediate_size=384,
        num_hidden_layers=4,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=32,
        rms_norm_eps=1e-6,
        rope_theta=10000.0,
        max_position_embeddings=4096,
        tie_word_embeddings=True,
        attention_bias=True,
    )
    base.update(overrides)
    return ModelConfig(**base)


def environment_corpus(seed: int = 0, episodes_per_env: int = 24) -> list[str]:
    """Text the tokenizer must encode compactly, produced by the environments themselves."""
    import jax

    from jaxrl_agentic.envs import make

    rng = random.Random(seed)
    texts = []
    specs = [("frozen_lake", {}), ("frozen_lake", {"hints": True}), ("sokoban", {}),
             ("sokoban", {"dim_room": 8, "num_boxes": 2})]
    for name, kwargs in specs:
        env, params = make(name, **kwargs)
        texts.append(env.instructions(params))
        key = jax.random.PRNGKey(seed)
        for _ in range(episodes_per_env):
            key, k_reset, k_step = jax.random.split(key, 3)
            _, state = env.reset(k_reset, params)
            for _ in range(3):
                for sep in ("", " "):  # both board layouts (`cell_separator`)
                    texts.append(env.render_text(state, params.replace(cell_separator=sep)))
                action = rng.randrange(len(env.action_names))
                k_step, k = jax.random.split(k_step)
                _, state, _, _, _, _ = env.step(k, state, action, params)
        for action in env.action_names:
            for style in (action, action.lower(), action.upper()):
                texts.append(f"<think>I should move {style}.</think><answer>{style}</answer>")
    texts += [
        "Turn 1. Reward: 0. You are at the start. Invalid action, the state did not change.",
        "The box is on the target. You fell into a hole. You reached the goal!",
    ]
    return texts


def build_tokenizer(texts: list[str], vocab_size: int = 512):
    """Byte-level BPE trained on `texts`, wrapped as a `PreTrainedTokenizerFast`."""
    from tokenizers import AddedToken, Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=list(SPECIAL_TOKENS),
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(texts, trainer=trainer)
    tok.add_tokens([AddedToken(t, special=False, normalized=False) for t in FORMAT_TOKENS])
    tok.add_tokens([AddedToken(t, special=False, normalized=False) for t in TOOL_TOKENS])
    return PreTrainedTokenizerFast(
        tokenizer_object=tok,
        eos_token="<|im_end|>",
        pad_token="<|endoftext|>",
        bos_token=None,
        chat_template=CHAT_TEMPLATE,
        clean_up_tokenization_spaces=False,
    )


def build_tiny_model(out: str, seed: int = 0, vocab_size: int = 512, **model_overrides) -> str:
    """Writes tokenizer + random-init tiny Qwen2 model to `out` (HF format). Returns `out`."""
    from flax import nnx

    from jaxrl_agentic.models.hf_io import save_pretrained
    from jaxrl_agentic.models.transformer import Transformer

    tokenizer = build_tokenizer(environment_corpus(seed), vocab_size=vocab_size)
    # Round the embedding table up to a multiple of 64 (matmul-friendly, like real checkpoints).
    vocab = -(-len(tokenizer) // 64) * 64
    cfg = tiny_model_config(
        vocab,
        eos_token_id=tokenizer.eos_token_id,
        bos_token_id=tokenizer.convert_tokens_to_ids("<|endoftext|>"),
        **model_overrides,
    )
    model = Transformer(cfg, rngs=nnx.Rngs(seed))
    save_pretrained(model, tokenizer, out)
    return out


def cache_dir() -> str:
    root = os.environ.get("JAXRL_AGENTIC_CACHE") or os.path.join(
        os.environ.get("XDG_CACHE_HOME", os.path.expanduser("~/.cache")), "jaxrl_agentic"
    )
    return root


@contextlib.contextmanager
def file_lock(path: str):
    """Holds an exclusive lock on the file `path` (across processes): callers that build the
    same cached directory take turns, and the later ones find it built."""
    os.makedirs(os.path.dirname(path), exist_ok=True)
    with open(path, "w") as f:
        fcntl.flock(f, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(f, fcntl.LOCK_UN)


def default_tiny_model_dir(seed: int = 0) -> str:
    """The cached tiny model directory, built on first use (safe under concurrent callers)."""
    out = os.path.join(cache_dir(), "models", f"tiny-{TINY_VERSION}-seed{seed}")
    if os.path.exists(os.path.join(out, "model.safetensors")):
        return out
    with file_lock(out + ".lock"):
        if not os.path.exists(os.path.join(out, "model.safetensors")):
            print(f"[jaxrl_agentic] building the tiny default model in {out}", file=sys.stderr)
            build_tiny_model(out, seed=seed)
    return out


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", required=True, help="output directory (HF format)")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--vocab-size", type=int, default=512)
    args = parser.parse_args(argv)
    if os.path.exists(args.out) and os.listdir(args.out):
        # save_pretrained replaces the directory atomically; refuse to clobber other content.
        if not os.path.exists(os.path.join(args.out, "config.json")):
            print(f"error: --out {args.out} exists and is not a model directory", file=sys.stderr)
            return 2
    with tempfile.TemporaryDirectory() as scratch:
        tmp_out = os.path.join(scratch, "model")
        build_tiny_model(tmp_out, seed=args.seed, vocab_size=args.vocab_size)
        if os.path.exists(args.out):
            shutil.rmtree(args.out)
        shutil.copytree(tmp_out, args.out)
    print(args.out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
