"""Conversations rendered with a real model's own chat template (SmolLM2-135M-Instruct's,
read from its GGUF file): the stream the learner trains on is the template's rendering."""

import pytest

from jaxrl_agentic.envs.tools import format_tool_call
from jaxrl_agentic.models.hf_io import load_tokenizer
from jaxrl_agentic.rollout.conversation import ChatFormatter, tools_system_text

SCHEMA = {"type": "function", "function": {
    "name": "add", "description": "a + b",
    "parameters": {"type": "object", "properties": {"a": {"type": "number"},
                                                    "b": {"type": "number"}}}}}


@pytest.fixture(scope="module")
def tokenizer(smollm2_dir):
    return load_tokenizer(smollm2_dir)


def _play(formatter, tokenizer, first, tools=None):
    """A three-turn episode: a reply, an observation, a tool call and its result, a reply."""
    replies = ["I will move <answer>Right</answer>",
               format_tool_call("add", {"a": 17, "b": 25}), "<answer>42</answer>"]
    stream = formatter.first_prompt(first, tools=tools)
    messages = [{"role": "user", "content": first}]
    follow = [("user", "You moved right. Now add 17 and 25."), ("tool", "42")]
    for i, reply in enumerate(replies):
        stream += tokenizer.encode(reply, add_special_tokens=False) + [formatter.eos_token_id]
        messages.append({"role": "assistant", "content": reply})
        if i < len(follow):
            role, content = follow[i]
            stream += (formatter.next_prompt(content) if role == "user"
                       else formatter.tool_prompt([content]))
            messages.append({"role": role, "content": content})
    return stream, messages


def test_the_stream_is_the_templates_rendering_with_its_default_system_prompt(tokenizer):
    formatter = ChatFormatter(tokenizer)
    assert not formatter.template_lists_tools
    assert formatter.default_system_prompt == (
        "You are a helpful AI assistant named SmolLM, trained by Hugging Face")
    stream, messages = _play(formatter, tokenizer, "You are on a frozen lake. Move?")
    text = tokenizer.apply_chat_template(messages, tokenize=False)
    # ... up to the newline the template writes after the last EOS (the next turn's piece)
    assert stream + tokenizer.encode("\n") == tokenizer.encode(text, add_special_tokens=False)
    assert text.startswith("<|im_start|>system\nYou are a helpful AI assistant named SmolLM")


def test_tools_are_described_in_the_system_turn_when_the_template_has_no_tools_block(
        tokenizer):
    for system_prompt in (None, "You solve arithmetic with tools."):
        formatter = ChatFormatter(tokenizer, system_prompt=system_prompt)
        stream, messages = _play(formatter, tokenizer, "What is 17 + 25?", tools=[SCHEMA])
        system = (system_prompt or formatter.default_system_prompt) + "\n\n" + \
            tools_system_text([SCHEMA])
        text = tokenizer.apply_chat_template([{"role": "system", "content": system}]
                                             + messages, tokenize=False)
        assert stream + tokenizer.encode("\n") == tokenizer.encode(text,
                                                                   add_special_tokens=False)
        assert '\n{"type": "function", "function": {"name": "add"' in text
        assert "<tool_call>\n{\"name\": <function-name>" in text
