"""The Qwen2.5 fixture: the real tokenizer's ids, the architecture, and HF's own forward."""

import json
import os

import numpy as np
import torch
import transformers

from jaxrl_agentic.models import load_pretrained
from jaxrl_agentic.models.qwen_fixture import ADDED_TOKENS, main


def test_the_tokenizer_gives_qwen25_ids(qwen_fixture_dir):
    tok = transformers.AutoTokenizer.from_pretrained(qwen_fixture_dir)
    # Known Qwen2/Qwen2.5 encodings (ids = tiktoken ranks).
    assert tok.encode("Hello world!", add_special_tokens=False) == [9707, 1879, 0]
    assert len(tok) == 151_665
    assert tok.eos_token_id == 151_645 and tok.pad_token_id == 151_643
    ids = tok.convert_tokens_to_ids([t for t, _ in ADDED_TOKENS])
    assert ids == list(range(151_643, 151_665))
    assert tok.convert_tokens_to_ids(["<tool_call>", "</tool_call>"]) == [151_657, 151_658]
    # Tool-call tags are one token each and survive decoding with special tokens skipped.
    text = '<tool_call>{"name": "f", "arguments": {}}</tool_call>'
    enc = tok.encode(text, add_special_tokens=False)
    assert enc[0] == 151_657 and enc[-1] == 151_658
    assert tok.decode(enc, skip_special_tokens=True) == text
    # Digits are split one by one (Qwen's \p{N} pre-tokenisation).
    assert len(tok.encode("12345", add_special_tokens=False)) == 5


def test_the_chat_template_matches_qwen25(qwen_fixture_dir):
    tok = transformers.AutoTokenizer.from_pretrained(qwen_fixture_dir)
    tools = [{"type": "function", "function": {"name": "f", "description": "d",
                                                "parameters": {"type": "object"}}}]
    text = tok.apply_chat_template(
        [{"role": "user", "content": "q"},
         {"role": "assistant", "content": "", "tool_calls": [
             {"function": {"name": "f", "arguments": {"x": 1}}}]},
         {"role": "tool", "content": "r1"}, {"role": "tool", "content": "r2"}],
        tools=tools, tokenize=False, add_generation_prompt=True)
    # Hand-written from Qwen2.5-Instruct's template.
    expected = (
        "<|im_start|>system\nYou are Qwen, created by Alibaba Cloud. You are a helpful "
        "assistant.\n\n# Tools\n\nYou may call one or more functions to assist with the user "
        "query.\n\nYou are provided with function signatures within <tools></tools> XML tags:"
        "\n<tools>\n" + json.dumps(tools[0]) + "\n</tools>\n\nFor each function call, return "
        "a json object with function name and arguments within <tool_call></tool_call> XML "
        "tags:\n<tool_call>\n{\"name\": <function-name>, \"arguments\": <args-json-object>}\n"
        "</tool_call><|im_end|>\n<|im_start|>user\nq<|im_end|>\n<|im_start|>assistant\n"
        "<tool_call>\n{\"name\": \"f\", \"arguments\": {\"x\": 1}}\n</tool_call><|im_end|>\n"
        "<|im_start|>user\n<tool_response>\nr1\n</tool_response>\n<tool_response>\nr2\n"
        "</tool_response><|im_end|>\n<|im_start|>assistant\n")
    assert text == expected
    plain = tok.apply_chat_template([{"role": "system", "content": "s"},
                                     {"role": "user", "content": "u"}], tokenize=False)
    assert plain == "<|im_start|>system\ns<|im_end|>\n<|im_start|>user\nu<|im_end|>\n"


def test_the_model_has_the_qwen25_architecture_and_matches_transformers(qwen_fixture_dir):
    with open(os.path.join(qwen_fixture_dir, "config.json")) as f:
        cfg = json.load(f)
    assert cfg["model_type"] == "qwen2" and cfg["vocab_size"] == 151_936
    assert cfg["num_attention_heads"] == 14 and cfg["num_key_value_heads"] == 2
    assert cfg["hidden_size"] == 56 and cfg["num_hidden_layers"] == 2
    assert cfg["rms_norm_eps"] == 1e-6 and cfg["tie_word_embeddings"] is True
    assert (cfg.get("rope_theta") or cfg["rope_parameters"]["rope_theta"]) == 1_000_000.0
    model, tok = load_pretrained(qwen_fixture_dir)
    ids = tok.encode("Hello world! 12 + 30 = 42", add_special_tokens=False)
    ours = np.asarray(model(np.asarray([ids]), np.arange(len(ids))[None], segment_ids=None))
    hf = transformers.AutoModelForCausalLM.from_pretrained(qwen_fixture_dir,
                                                           dtype=torch.float32)
    with torch.no_grad():
        theirs = hf(torch.tensor([ids])).logits.numpy()
    np.testing.assert_allclose(ours, theirs, atol=2e-4, rtol=2e-4)


def test_the_command_rejects_a_foreign_directory(tmp_path, capsys):
    (tmp_path / "notes.txt").write_text("keep me")
    assert main(["--out", str(tmp_path), "--layers", "1", "--hidden", "28"]) == 2
    assert "not a model directory" in capsys.readouterr().err
    assert main(["--out", str(tmp_path / "m"), "--hidden", "30"]) == 2  # 30 % 14 != 0
