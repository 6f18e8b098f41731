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
import os
import random
import shutil
import sys
import tempfile

from jaxrl_agentic.models.config import ModelConfig
from jaxrl_agentic.models.files import cache_dir, file_lock

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

# The tool recipes' model (`pretrain="tiny-tools"`): the same architecture; its tokenizer
# is trained on the tool environments' text as well (problems, schemas, calls, results),
# with a larger vocabulary, one token per digit, and the JSON between the call tags as a
# few added tokens, so one call of a one-operation problem is ~17 tokens (~60 with the
# default tokenizer, which spells JSON byte by byte).
# v2: the tools block is a few tokens. The template's fixed text before and after the
# schemas (`TOOLS_HEADER`, `TOOLS_FOOTER`) and the JSON schema of each of the project's own
# tools are added tokens, so the calculator's first prompt is ~73 tokens rather than 240 and
# the shop's ~75 rather than 303: the tiny model, trained from random weights by the format
# warm-up, copied numbers far worse the further into its context an episode began
# (docs/benchmarks.md, "Tool use over several turns"). Another tool's schema is spelled
# by the BPE as before.
TOOLS_VERSION = "v2"
TOOLS_VOCAB_SIZE = 1024
CALL_TOKENS = ('{"name": "', '", "arguments": {"', '": "', '", "', '"}}')
TOOLS_HEADER = ("# Tools\n\nYou may call functions. Their signatures are in "
                "<tools></tools>:\n<tools>")
TOOLS_FOOTER = ("\n</tools>\n\nCall one with <tool_call>{\"name\": <function-name>, "
                "\"arguments\": <args-json-object>}</tool_call>.")
PRETRAINED_NAMES = ("tiny", "tiny-tools")


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


# The tool environments the tiny-tools tokenizer is trained on, with their settings.
TOOL_ENVS = (("calculator", {"operations": 1}), ("calculator", {}), ("lookup", {}),
             ("shop", {}))


def tool_schema_texts() -> tuple[str, ...]:
    """Each JSON schema of `TOOL_ENVS`' tools as the chat template writes it (transformers'
    `tojson`: `json.dumps` with `ensure_ascii=False`), in a fixed order."""
    import json

    from jaxrl_agentic.envs.python_env import make_python_env

    texts: dict[str, None] = {}
    for name, config in TOOL_ENVS:
        env = make_python_env(name, **config)(_Episode(0), 0)
        texts.update((json.dumps(t, ensure_ascii=False), None) for t in env.tool_schemas)
    return tuple(texts)


class _Episode:  # an `EpisodeKey`
    def __init__(self, seed: int):
        self.seed, self.group_id, self.member = seed, 0, 0


def tool_corpus(seed: int = 0, episodes_per_env: int = 150) -> list[str]:
    """Text of the tool environments: first messages (with the tools' schemas as the chat
    template lists them), the oracles' calls in both call styles, results and answers."""
    import json

    from jaxrl_agentic.envs.calculator import CalculatorOracle
    from jaxrl_agentic.envs.lookup import LookupOracle
    from jaxrl_agentic.envs.python_env import make_python_env
    from jaxrl_agentic.envs.shop import ShopOracle
    from jaxrl_agentic.envs.tools import CALL_STYLES, tool_response_text

    oracles = {"calculator": CalculatorOracle, "lookup": LookupOracle, "shop": ShopOracle}
    texts = []
    for name, config in TOOL_ENVS:
        oracle = oracles[name]
        for style in CALL_STYLES:
            factory = make_python_env(name, call_style=style, **config)
            for s in range(episodes_per_env):
                env = factory(_Episode(s), seed)
                text = env.reset(s)
                if s == 0:
                    texts += [json.dumps(t) for t in env.tool_schemas]
                texts.append(text)
                policy = oracle(style)
                for _ in range(env.max_steps_in_episode):
                    reply = policy.reply(text)
                    step = env.step(reply)
                    texts.append(reply)
                    if step.terminated:
                        break
                    text = (tool_response_text(step.tool_messages) if step.tool_messages
                            else step.observation)
                    texts.append(text)
    return texts


def build_tokenizer(texts: list[str], vocab_size: int = 512, extra_tokens: tuple = (),
                    single_digits: bool = False):
    """Byte-level BPE trained on `texts`, wrapped as a `PreTrainedTokenizerFast`;
    `extra_tokens` are added after the format and tool tags; `single_digits`: every digit
    is its own token (as in Qwen's tokenizer), so a number is spelled the same way wherever
    it appears and copying it is copying digits."""
    from tokenizers import AddedToken, Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    if single_digits:
        tok.pre_tokenizer = pre_tokenizers.Sequence([
            pre_tokenizers.Digits(individual_digits=True), tok.pre_tokenizer])
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
    if extra_tokens:
        tok.add_tokens([AddedToken(t, special=False, normalized=False) for t in extra_tokens])
    return PreTrainedTokenizerFast(
        tokenizer_object=tok,
        eos_token="<|im_end|>",
        pad_token="<|endoftext|>",
        bos_token=None,
        chat_template=CHAT_TEMPLATE,
        clean_up_tokenization_spaces=False,
    )


def build_tiny_model(out: str, seed: int = 0, vocab_size: int | None = None, *,
                     tools: bool = False, **model_overrides) -> str:
    """Writes tokenizer + random-init tiny Qwen2 model to `out` (HF format). Returns `out`.
    `tools`: the tool recipes' variant (tokenizer also trained on `tool_corpus`, vocabulary
    `TOOLS_VOCAB_SIZE`, `CALL_TOKENS` added)."""
    from flax import nnx

    from jaxrl_agentic.models.hf_io import save_pretrained
    from jaxrl_agentic.models.transformer import Transformer

    if tools:
        tokenizer = build_tokenizer(environment_corpus(seed) + tool_corpus(seed),
                                    vocab_size=vocab_size or TOOLS_VOCAB_SIZE,
                                    extra_tokens=(*CALL_TOKENS, TOOLS_HEADER, TOOLS_FOOTER,
                                                  *tool_schema_texts()),
                                    single_digits=True)
    else:
        tokenizer = build_tokenizer(environment_corpus(seed), vocab_size=vocab_size or 512)
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


def default_tiny_model_dir(seed: int = 0, tools: bool = False) -> str:
    """The cached tiny model directory (`tools`: the tool recipes' variant), built on first
    use (safe under concurrent callers)."""
    name = f"tiny-tools-{TOOLS_VERSION}" if tools else f"tiny-{TINY_VERSION}"
    out = os.path.join(cache_dir(), "models", f"{name}-seed{seed}")
    if os.path.exists(os.path.join(out, "model.safetensors")):
        return out
    with file_lock(out + ".lock"):
        if not os.path.exists(os.path.join(out, "model.safetensors")):
            print(f"[jaxrl_agentic] building the {name} model in {out}", file=sys.stderr)
            build_tiny_model(out, seed=seed, tools=tools)
    return out


def pretrained_dir(name: str) -> str | None:
    """The directory of a built-in model name (`PRETRAINED_NAMES`), or None for a path."""
    if name in PRETRAINED_NAMES:
        return default_tiny_model_dir(tools=name == "tiny-tools")
    return None


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", required=True, help="output directory (HF format)")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--vocab-size", type=int, default=None,
                        help=f"default 512, or {TOOLS_VOCAB_SIZE} with --tools")
    parser.add_argument("--tools", action="store_true",
                        help="the tool recipes' variant (pretrain='tiny-tools')")
    args = parser.parse_args(argv)
    if os.path.exists(args.out) and os.listdir(args.out):
        # save_pretrained replaces the directory atomically; refuse to clobber other content.
        if not os.path.exists(os.path.join(args.out, "config.json")):
            print(f"error: --out {args.out} exists and is not a model directory", file=sys.stderr)
            return 2
    with tempfile.TemporaryDirectory() as scratch:
        tmp_out = os.path.join(scratch, "model")
        build_tiny_model(tmp_out, seed=args.seed, vocab_size=args.vocab_size,
                         tools=args.tools)
        if os.path.exists(args.out):
            shutil.rmtree(args.out)
        shutil.copytree(tmp_out, args.out)
    print(args.out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
