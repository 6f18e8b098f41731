"""The tool recipes' tiny model (`pretrain="tiny-tools"`): a calculator call is a handful
of tokens, numbers are spelled digit by digit, the tools block of the project's own tools is
a few tokens, and the chat renders as the default tiny model's template does."""

import json

import pytest
import transformers

from jaxrl_agentic.envs.calculator import CalculatorOracle
from jaxrl_agentic.envs.python_env import make_python_env
from jaxrl_agentic.models.tiny import (
    CALL_TOKENS,
    TOOL_TOKENS,
    TOOLS_FOOTER,
    TOOLS_HEADER,
    pretrained_dir,
    tool_schema_texts,
)
from jaxrl_agentic.rollout.groups import EpisodeSpec


@pytest.fixture(scope="module")
def tools_tok(tiny_tools_dir):
    return transformers.AutoTokenizer.from_pretrained(tiny_tools_dir)


def _calls(style, seeds):
    factory = make_python_env("calculator", operations=1, call_style=style)
    for seed in seeds:
        env = factory(EpisodeSpec(seed, 0, 0), 0)
        text = env.reset(seed)
        yield env, text, CalculatorOracle(style).reply(text)


@pytest.mark.parametrize("style, most", [("compact", 20), ("qwen", 22)])
def test_a_one_operation_call_is_a_handful_of_tokens(tools_tok, tiny_model_dir, style, most):
    default = transformers.AutoTokenizer.from_pretrained(tiny_model_dir)
    held_out = range(10_000, 10_040)  # seeds the tokenizer's corpus did not draw
    for _, _, call in _calls(style, held_out):
        ids = tools_tok.encode(call)
        assert len(ids) <= most and tools_tok.decode(ids) == call
        assert len(default.encode(call)) >= 45  # the default tokenizer spells the JSON


def test_numbers_are_digits_and_the_call_json_is_added_tokens(tools_tok):
    assert tools_tok.tokenize("8381") == ["8", "3", "8", "1"]
    for piece in CALL_TOKENS + TOOL_TOKENS:
        assert tools_tok.tokenize(piece) == [piece]
    call = json.dumps({"name": "calculate", "arguments": {"expression": "12 * 4"}})
    assert tools_tok.tokenize(call)[:3] == ['{"name": "', "calculate", '", "arguments": {"']


@pytest.mark.parametrize("name, config, tools", [
    ("calculator", {"operations": 1, "number_size": "two_digit"}, 1), ("shop", {}, 2)])
def test_the_tools_block_of_the_projects_tools_is_a_few_tokens(tools_tok, name, config, tools):
    env = make_python_env(name, **config)(EpisodeSpec(3, 0, 0), 0)
    assert len(env.tool_schemas) == tools
    chat = [{"role": "user", "content": env.reset(3)}]
    ids = tools_tok.encode(tools_tok.apply_chat_template(
        chat, tools=env.tool_schemas, tokenize=False, add_generation_prompt=True))
    pieces = tools_tok.convert_ids_to_tokens(ids)
    block = pieces[pieces.index(TOOLS_HEADER):pieces.index(TOOLS_FOOTER) + 1]
    assert block == [TOOLS_HEADER, *[p for t in env.tool_schemas for p in ("Ċ", json.dumps(t))],
                     TOOLS_FOOTER]
    assert len(ids) <= 80  # 240 and 303 with the schemas spelled out


def test_another_tools_schema_is_spelled_out_losslessly(tools_tok):
    assert all(tools_tok.tokenize(text) == [text] for text in tool_schema_texts())
    tool = {"type": "function", "function": {"name": "weather", "description": "Today's.",
                                             "parameters": {"type": "object", "properties": {}}}}
    chat = [{"role": "user", "content": "Rain?"}]
    text = tools_tok.apply_chat_template(chat, tools=[tool], tokenize=False)
    assert TOOLS_HEADER in text and TOOLS_FOOTER in text  # the template writes what v2 adds
    ids = tools_tok.encode(json.dumps(tool))
    assert len(ids) > 20 and tools_tok.decode(ids) == json.dumps(tool)


def test_the_chat_and_the_model_are_the_tiny_ones(tools_tok, tiny_tools_dir, tiny_model_dir):
    default = transformers.AutoTokenizer.from_pretrained(tiny_model_dir)
    env, text, _ = next(_calls("compact", [3]))
    chat = [{"role": "user", "content": text}]
    assert tools_tok.chat_template == default.chat_template
    rendered = tools_tok.apply_chat_template(chat, tools=env.tool_schemas, tokenize=False,
                                             add_generation_prompt=True)
    assert rendered == default.apply_chat_template(chat, tools=env.tool_schemas,
                                                   tokenize=False, add_generation_prompt=True)
    with open(f"{tiny_tools_dir}/config.json") as f:
        tools_cfg = json.load(f)
    with open(f"{tiny_model_dir}/config.json") as f:
        default_cfg = json.load(f)
    assert tools_cfg["vocab_size"] >= len(tools_tok) and tools_cfg["vocab_size"] % 64 == 0
    for key in ("hidden_size", "num_hidden_layers", "num_attention_heads", "model_type"):
        assert tools_cfg[key] == default_cfg[key]
    assert pretrained_dir("tiny-tools") == tiny_tools_dir
    assert pretrained_dir("tiny") == tiny_model_dir and pretrained_dir("/some/dir") is None
