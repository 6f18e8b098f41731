"""JAX logits vs `transformers` PyTorch logits on random-weight checkpoints made here."""

import json
import os

import jax.numpy as jnp
import numpy as np
import pytest
import torch
import transformers

from jaxrl_agentic.models import CheckpointError, load_pretrained, save_pretrained
from jaxrl_agentic.models.hf_io import read_model_config
from jaxrl_agentic.models.tiny import build_tokenizer
from pallas_kernels.segment_attention import BLOCK

VOCAB = 320


@pytest.fixture(scope="module")
def tokenizer():
    texts = ["<think>go left</think><answer>Left</answer>", "P _ O G\n_ _ O _", "# # X O P S"] * 4
    return build_tokenizer(texts, vocab_size=300)


def _small(**kw):
    return dict(
        vocab_size=VOCAB,
        hidden_size=64,
        intermediate_size=112,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=256,
        rms_norm_eps=1e-6,
        **kw,
    )


CASES = {
    "qwen2_tied_qkv_bias": lambda: transformers.Qwen2Config(**_small(tie_word_embeddings=True)),
    "llama3_untied_gqa_llama3_rope": lambda: transformers.LlamaConfig(
        **_small(
            tie_word_embeddings=False,
            head_dim=16,
            rope_parameters={
                "rope_type": "llama3",
                "rope_theta": 500000.0,
                "factor": 8.0,
                "low_freq_factor": 1.0,
                "high_freq_factor": 4.0,
                "original_max_position_embeddings": 64,
            },
        )
    ),
    "qwen3_qk_norm": lambda: transformers.Qwen3Config(
        **_small(tie_word_embeddings=False, head_dim=24)
    ),
    "qwen2_yarn_rope": lambda: transformers.Qwen2Config(
        **_small(
            tie_word_embeddings=True,
            rope_parameters={
                "rope_type": "yarn",
                "rope_theta": 1000000.0,
                "factor": 4.0,
                "original_max_position_embeddings": 64,
            },
        )
    ),
    "llama_linear_rope_attention_bias": lambda: transformers.LlamaConfig(
        **_small(
            tie_word_embeddings=True,
            attention_bias=True,
            rope_parameters={"rope_type": "linear", "rope_theta": 10000.0, "factor": 2.0},
        )
    ),
}


def _make_checkpoint(cfg, path, tokenizer, **save_kw):
    torch.manual_seed(0)
    model = transformers.AutoModelForCausalLM.from_config(cfg, attn_implementation="eager")
    with torch.no_grad():  # perturb every tensor so norms and biases are not at their init
        for p in model.parameters():
            p.add_(torch.randn_like(p) * 0.05)
    model.eval()
    model.save_pretrained(path, **save_kw)
    tokenizer.save_pretrained(path)
    return model


def _torch_logits(model, tokens):
    with torch.no_grad():
        return model(torch.tensor(tokens)).logits.float().numpy()


def _jax_logits(model, tokens):
    tokens = jnp.asarray(tokens)
    positions = jnp.broadcast_to(jnp.arange(tokens.shape[1]), tokens.shape)
    return np.asarray(model(tokens, positions))


@pytest.mark.parametrize("case", sorted(CASES))
def test_logits_match_transformers(case, tmp_path, tokenizer):
    hf_model = _make_checkpoint(CASES[case](), tmp_path / "ckpt", tokenizer)
    tokens = np.random.default_rng(0).integers(0, VOCAB, size=(2, 96))
    model, tok = load_pretrained(str(tmp_path / "ckpt"))
    assert len(tok) == len(tokenizer)
    diff = np.abs(_jax_logits(model, tokens) - _torch_logits(hf_model, tokens)).max()
    assert diff <= 1e-4, f"{case}: max abs logit diff {diff}"

    # Round trip: our save → transformers load → the same logits.
    save_pretrained(model, tok, str(tmp_path / "resaved"))
    reloaded = transformers.AutoModelForCausalLM.from_pretrained(
        str(tmp_path / "resaved"), attn_implementation="eager"
    ).eval()
    diff_rt = np.abs(_torch_logits(reloaded, tokens) - _torch_logits(hf_model, tokens)).max()
    assert diff_rt <= 1e-6, f"{case}: round trip changed logits by {diff_rt}"
    # The model class is named as `transformers`' own save names it: tools that pick the
    # class from config.json (TRL's GRPOTrainer(model=<dir>), vLLM) refuse a directory without.
    def architectures(folder):
        return json.loads((tmp_path / folder / "config.json").read_text())["architectures"]

    assert architectures("resaved") == architectures("ckpt") == [type(hf_model).__name__]


def test_sharded_checkpoint_loads(tmp_path, tokenizer):
    cfg = CASES["qwen2_tied_qkv_bias"]()
    hf_model = _make_checkpoint(cfg, tmp_path / "ckpt", tokenizer, max_shard_size="60KB")
    assert os.path.exists(tmp_path / "ckpt" / "model.safetensors.index.json")
    tokens = np.arange(40).reshape(2, 20) % VOCAB
    model, _ = load_pretrained(str(tmp_path / "ckpt"))
    assert np.abs(_jax_logits(model, tokens) - _torch_logits(hf_model, tokens)).max() <= 1e-4


def test_untie_word_embeddings_copies_the_head_and_saves_untied(tmp_path, tokenizer):
    """A tied checkpoint loaded untied: the head is a copy of the embedding (the logits of
    transformers' tied model), the two are separate parameters, and the saved model is an
    untied HF checkpoint whose head transformers reads back."""
    hf_model = _make_checkpoint(CASES["qwen2_tied_qkv_bias"](), tmp_path / "ckpt", tokenizer)
    tokens = np.random.default_rng(1).integers(0, VOCAB, size=(2, 40))
    model, tok = load_pretrained(str(tmp_path / "ckpt"), untie_word_embeddings=True)
    assert not model.cfg.tie_word_embeddings
    # The memory plan's config (read without weights) is the one the model is built from.
    assert read_model_config(str(tmp_path / "ckpt"), untie_word_embeddings=True) == model.cfg
    embedding = np.asarray(model.embed.embedding[...])
    np.testing.assert_array_equal(np.asarray(model.lm_head.kernel[...]), embedding.T)
    assert np.abs(_jax_logits(model, tokens) - _torch_logits(hf_model, tokens)).max() <= 1e-4

    model.lm_head.kernel[...] = model.lm_head.kernel[...] * 0.5  # trained apart from here on
    np.testing.assert_array_equal(np.asarray(model.embed.embedding[...]), embedding)
    save_pretrained(model, tok, str(tmp_path / "untied"))
    with open(tmp_path / "untied" / "config.json") as f:
        assert json.load(f)["tie_word_embeddings"] is False
    reloaded = transformers.AutoModelForCausalLM.from_pretrained(
        str(tmp_path / "untied"), attn_implementation="eager").eval()
    np.testing.assert_allclose(reloaded.lm_head.weight.detach().numpy(), 0.5 * embedding,
                               rtol=1e-6)
    # An untied checkpoint is left as it is.
    again, _ = load_pretrained(str(tmp_path / "untied"), untie_word_embeddings=True)
    np.testing.assert_allclose(np.asarray(again.lm_head.kernel[...]), 0.5 * embedding.T,
                               rtol=1e-6)


def test_packed_forward_equals_separate(tmp_path, tokenizer):
    _make_checkpoint(CASES["qwen3_qk_norm"](), tmp_path / "ckpt", tokenizer)
    model, _ = load_pretrained(str(tmp_path / "ckpt"))
    rng = np.random.default_rng(1)
    a, b = rng.integers(0, VOCAB, 7), rng.integers(0, VOCAB, 5)
    row = np.zeros(16, np.int32)
    row[:7], row[7:12] = a, b
    positions = np.concatenate([np.arange(7), np.arange(5), np.zeros(4, int)])
    segments = np.array([1] * 7 + [2] * 5 + [0] * 4)
    packed = np.asarray(model(jnp.asarray(row[None]), jnp.asarray(positions[None]),
                              jnp.asarray(segments[None])))[0]
    alone_a = _jax_logits(model, a[None])[0]
    alone_b = _jax_logits(model, b[None])[0]
    assert np.abs(packed[:7] - alone_a).max() <= 1e-5
    assert np.abs(packed[7:12] - alone_b).max() <= 1e-5
    assert np.isfinite(packed).all()  # padding rows stay finite


def test_long_packed_rows_use_segment_attention_exactly(tmp_path, tokenizer):
    """Rows longer than 2·BLOCK take the block-sparse path (only the block pairs the
    segments need): a packed row of three segments, one crossing block edges, against
    transformers' forward of each segment alone."""
    hf_model = _make_checkpoint(CASES["qwen2_tied_qkv_bias"](), tmp_path / "ckpt", tokenizer)
    model, _ = load_pretrained(str(tmp_path / "ckpt"))
    lengths, row_len = (150, 160, 37), 3 * BLOCK - 11  # ragged last block
    assert row_len > 2 * BLOCK and sum(lengths) < row_len
    rng = np.random.default_rng(2)
    seqs = [rng.integers(0, VOCAB, n) for n in lengths]
    row = np.zeros(row_len, np.int32)
    positions, segments = np.zeros(row_len, np.int32), np.zeros(row_len, np.int32)
    start = 0
    for i, seq in enumerate(seqs):
        end = start + len(seq)
        row[start:end], positions[start:end], segments[start:end] = seq, np.arange(len(seq)), i + 1
        start = end
    packed = np.asarray(model(jnp.asarray(row[None]), jnp.asarray(positions[None]),
                              jnp.asarray(segments[None])))[0]
    start = 0
    for seq in seqs:
        reference = _torch_logits(hf_model, seq[None])[0]
        diff = np.abs(packed[start:start + len(seq)] - reference).max()
        assert diff <= 1e-4, f"segment at {start}: max abs logit diff {diff}"
        start += len(seq)
    assert np.isfinite(packed).all()  # padding rows stay finite


def _one_line(exc):
    msg = str(exc.value)
    assert "\n" not in msg and msg
    return msg


def test_error_wrong_path():
    with pytest.raises(CheckpointError) as e:
        load_pretrained("/nonexistent/model/dir")
    assert "/nonexistent/model/dir" in _one_line(e)


def test_error_missing_tokenizer(tmp_path, tokenizer):
    _make_checkpoint(CASES["qwen2_tied_qkv_bias"](), tmp_path / "ckpt", tokenizer)
    for name in os.listdir(tmp_path / "ckpt"):
        if "token" in name or name.endswith(".jinja"):
            os.remove(tmp_path / "ckpt" / name)
    with pytest.raises(CheckpointError) as e:
        load_pretrained(str(tmp_path / "ckpt"))
    assert "tokenizer" in _one_line(e)


def test_error_unsupported_model_type(tmp_path, tokenizer):
    transformers.GPT2Config(n_layer=1, n_embd=32, n_head=2).save_pretrained(tmp_path / "g")
    tokenizer.save_pretrained(tmp_path / "g")
    with pytest.raises(CheckpointError) as e:
        load_pretrained(str(tmp_path / "g"))
    msg = _one_line(e)
    assert "gpt2" in msg and "not supported" in msg and "config.json" in msg


def test_error_shape_mismatch_names_file_and_key(tmp_path, tokenizer):
    _make_checkpoint(CASES["qwen2_tied_qkv_bias"](), tmp_path / "ckpt", tokenizer)
    cfg_file = tmp_path / "ckpt" / "config.json"
    cfg = json.loads(cfg_file.read_text())
    cfg["intermediate_size"] = 96
    cfg_file.write_text(json.dumps(cfg))
    with pytest.raises(CheckpointError) as e:
        load_pretrained(str(tmp_path / "ckpt"))
    msg = _one_line(e)
    assert "model.safetensors" in msg and "mlp" in msg and "shape" in msg
