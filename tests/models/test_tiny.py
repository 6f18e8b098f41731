"""The tiny model's v3 tokenizer: tool tags in spare ids, everything without tools as in v2."""

import json
import os
import shutil

import jax
import pytest
import transformers

from jaxrl_agentic.envs import make
from jaxrl_agentic.envs.messages import feedback_message, first_message
from jaxrl_agentic.models.tiny import TOOL_TOKENS

# The v2 template, verbatim: chats without tools must render exactly as it did.
V2_TEMPLATE = (
    "{% for message in messages %}"
    "{{ '<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>' + '\\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}"
)


@pytest.fixture(scope="module")
def tok(tiny_model_dir):
    return transformers.AutoTokenizer.from_pretrained(tiny_model_dir)


def _without_tool_tokens(tiny_model_dir, tmp_dir):
    """The v2 tokenizer: v3's files less the four tool tags (same merges), loaded the way
    `load_pretrained` loads a model's tokenizer (config.json included: `transformers` picks
    the tokenizer class from the model type)."""
    for name in os.listdir(tiny_model_dir):
        if name.endswith(".json") or name.endswith(".jinja"):
            shutil.copy(os.path.join(tiny_model_dir, name), tmp_dir)
    with open(os.path.join(tmp_dir, "tokenizer.json")) as f:
        spec = json.load(f)
    spec["added_tokens"] = [t for t in spec["added_tokens"] if t["content"] not in TOOL_TOKENS]
    with open(os.path.join(tmp_dir, "tokenizer.json"), "w") as f:
        json.dump(spec, f)
    v2 = transformers.AutoTokenizer.from_pretrained(tmp_dir)
    v2.chat_template = V2_TEMPLATE
    return v2


def _texts():
    out = []
    for name, kw in [("frozen_lake", dict(cell_separator=" ", hints=True, hint_style="short",
                                          brief_instructions=True)), ("sokoban", {})]:
        env, params = make(name, **kw)
        for seed in range(4):
            _, state = env.reset(jax.random.PRNGKey(seed), params)
            out.append(first_message(env, state, params))
            out.append(feedback_message(env, state, params, -0.5, 1))
    return out


def test_tool_tags_take_spare_ids_below_the_embedding_size(tok, tiny_model_dir):
    ids = tok.convert_tokens_to_ids(list(TOOL_TOKENS))
    assert ids == [516, 517, 518, 519] and len(tok) == 520
    with open(f"{tiny_model_dir}/config.json") as f:
        assert json.load(f)["vocab_size"] == 576
    call = '<tool_call>{"name": "f"}</tool_call>'
    enc = tok.encode(call, add_special_tokens=False)
    assert enc[0] == 516 and enc[-1] == 517
    assert tok.decode(enc, skip_special_tokens=True) == call  # not special: kept


def test_text_without_tools_tokenizes_and_renders_as_in_v2(tok, tiny_model_dir, tmp_path):
    v2 = _without_tool_tokens(tiny_model_dir, str(tmp_path))
    assert len(v2) == 516
    for text in _texts():
        chats = [
            [{"role": "user", "content": text}],
            [{"role": "system", "content": "Be brief."}, {"role": "user", "content": text},
             {"role": "assistant", "content": "<answer>Left</answer>"},
             {"role": "user", "content": text}],
        ]
        for chat in chats:
            for gen in (False, True):
                rendered = tok.apply_chat_template(chat, tokenize=False,
                                                   add_generation_prompt=gen)
                assert rendered == v2.apply_chat_template(chat, tokenize=False,
                                                          add_generation_prompt=gen)
                assert tok.encode(rendered, add_special_tokens=False) == v2.encode(
                    rendered, add_special_tokens=False)


def test_tools_and_tool_messages_render_qwen_style(tok):
    tools = [{"type": "function", "function": {"name": "f", "description": "d",
                                                "parameters": {"type": "object"}}}]
    text = tok.apply_chat_template(
        [{"role": "system", "content": "S"}, {"role": "user", "content": "q"},
         {"role": "assistant", "content": "<tool_call>{}</tool_call>"},
         {"role": "tool", "content": "r1"}, {"role": "tool", "content": "r2"},
         {"role": "assistant", "content": "<answer>1</answer>"}],
        tools=tools, tokenize=False)
    assert text == (
        "<|im_start|>system\nS\n\n# Tools\n\nYou may call functions. Their signatures are in "
        "<tools></tools>:\n<tools>\n" + json.dumps(tools[0]) + "\n</tools>\n\nCall one with "
        "<tool_call>{\"name\": <function-name>, \"arguments\": <args-json-object>}"
        "</tool_call>.<|im_end|>\n<|im_start|>user\nq<|im_end|>\n<|im_start|>assistant\n"
        "<tool_call>{}</tool_call><|im_end|>\n<|im_start|>user\n<tool_response>\nr1\n"
        "</tool_response>\n<tool_response>\nr2\n</tool_response><|im_end|>\n"
        "<|im_start|>assistant\n<answer>1</answer><|im_end|>\n")
