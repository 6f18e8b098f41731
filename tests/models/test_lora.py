"""LoRA adapters: the adapted model is the base at init, its gradients are those of the
dense update W + s·A·B written out with plain `jax.grad`, and a learner trains the adapters
alone with the base as its KL reference."""

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from jaxrl_agentic.models import lora
from jaxrl_agentic.models.hf_io import save_peft_adapter
from jaxrl_agentic.models.transformer import Transformer
from jaxrl_agentic.training.learner import Learner
from tests.training.test_learner import BASE, MODEL_CFG, SAMPLES

TOKENS = jnp.asarray(np.random.default_rng(0).integers(1, 64, (2, 12)), jnp.int32)
POSITIONS = jnp.tile(jnp.arange(12), (2, 1))
SEGMENTS = jnp.asarray([[1] * 7 + [2] * 5, [1] * 12], jnp.int32)


def adapted(rank=4, alpha=8.0, targets=(), seed=0):
    model = Transformer(MODEL_CFG, rngs=nnx.Rngs(0))
    return lora.add_lora(model, lora.LoRAConfig(rank, alpha, targets), seed=seed)


def with_random_b(model, seed=1):
    """The adapters with B moved off 0 (as training moves it)."""
    graphdef, adapters, frozen = lora.split_trainable(model)
    key = jax.random.key(seed)
    leaves, tree = jax.tree_util.tree_flatten_with_path(adapters)
    moved = [0.1 * jax.random.normal(jax.random.fold_in(key, i), x.shape)
             if "lora_b" in jax.tree_util.keystr(p) else x
             for i, (p, x) in enumerate(leaves)]
    return graphdef, jax.tree_util.tree_unflatten(tree, moved), frozen


def merged_kernels(adapters, frozen, scale):
    """The base with every adapted kernel replaced by W + s·A·B (no adapters): the dense
    model the adapters stand for."""
    pure_a, pure_f = nnx.to_pure_dict(adapters), nnx.to_pure_dict(frozen)
    for part in ("attn", "mlp"):
        for name, ab in pure_a["layers"][part].items():
            w = pure_f["layers"][part][name]["kernel"]
            pure_f["layers"][part][name]["kernel"] = w + scale * jnp.einsum(
                "lir,lro->lio", ab["lora_a"], ab["lora_b"])
    return pure_f


def assert_peft_round_trip(base_cfg, split, tmp_path):
    """The base (`base_cfg`, seed 0) saved as a Hugging Face model and the adapters of
    `split` = (graphdef, adapters, frozen) as a PEFT directory: `peft` puts them on the base
    and `transformers` computes the adapted model's logits."""
    import peft
    import torch
    import transformers

    from jaxrl_agentic.models import save_pretrained

    save_pretrained(Transformer(base_cfg, rngs=nnx.Rngs(0)), None, str(tmp_path / "base"))
    graphdef, adapters, frozen = split
    model = nnx.merge(graphdef, lora.combine(adapters, frozen))
    save_peft_adapter(model, str(tmp_path / "adapter"), str(tmp_path / "base"))
    base = transformers.AutoModelForCausalLM.from_pretrained(str(tmp_path / "base"),
                                                             torch_dtype=torch.float32)
    hf = peft.PeftModel.from_pretrained(base, str(tmp_path / "adapter"))
    with torch.no_grad():
        got = hf(torch.as_tensor(np.asarray(TOKENS), dtype=torch.long)).logits.numpy()
    np.testing.assert_allclose(got, np.asarray(model(TOKENS, POSITIONS)), atol=1e-4)


def test_the_adapted_model_is_the_base_until_b_moves():
    base = Transformer(MODEL_CFG, rngs=nnx.Rngs(0))
    model = adapted()
    np.testing.assert_array_equal(model(TOKENS, POSITIONS, SEGMENTS),
                                  base(TOKENS, POSITIONS, SEGMENTS))
    graphdef, adapters, frozen = with_random_b(model)
    assert not np.allclose(nnx.merge(graphdef, lora.combine(adapters, frozen))(
        TOKENS, POSITIONS, SEGMENTS), base(TOKENS, POSITIONS, SEGMENTS), atol=1e-4)
    # B = 0 again (`base_only`): the base, whatever A and the moved B were.
    np.testing.assert_array_equal(
        nnx.merge(graphdef, lora.combine(lora.base_only(adapters, frozen), frozen))(
            TOKENS, POSITIONS, SEGMENTS), base(TOKENS, POSITIONS, SEGMENTS))


@pytest.mark.parametrize("targets", [(), ("q_proj", "down_proj")])
def test_adapter_gradients_equal_the_dense_update_by_the_chain_rule(targets):
    """loss(A, B) = f(W + s·A·B): dA = s·dW·Bᵀ and dB = s·Aᵀ·dW with dW the gradient of the
    dense model at the merged kernels (plain `jax.grad`, no adapters anywhere)."""
    scale = 8.0 / 4
    graphdef, adapters, frozen = with_random_b(adapted(targets=targets))
    weights = jax.random.normal(jax.random.key(3), (2, 12, MODEL_CFG.vocab_size))

    def loss_of(model):
        return jnp.sum(jax.nn.log_softmax(model(TOKENS, POSITIONS, SEGMENTS)) * weights)

    grads = jax.grad(lambda a: loss_of(nnx.merge(graphdef, lora.combine(a, frozen))))(adapters)
    dense_def, dense_state = nnx.split(Transformer(MODEL_CFG, rngs=nnx.Rngs(0)))
    merged = merged_kernels(adapters, frozen, scale)
    nnx.replace_by_pure_dict(dense_state, merged)
    dense = jax.grad(lambda s: loss_of(nnx.merge(dense_def, s)))(dense_state)
    g, d, a = nnx.to_pure_dict(grads), nnx.to_pure_dict(dense), nnx.to_pure_dict(adapters)
    names = 0
    for part in ("attn", "mlp"):
        for name in g["layers"][part]:
            names += 1
            dw = d["layers"][part][name]["kernel"]
            la, lb = a["layers"][part][name]["lora_a"], a["layers"][part][name]["lora_b"]
            for got, want in ((g["layers"][part][name]["lora_a"],
                               scale * jnp.einsum("lio,lro->lir", dw, lb)),
                              (g["layers"][part][name]["lora_b"],
                               scale * jnp.einsum("lir,lio->lro", la, dw))):
                # fp32: the two forms round differently, by ~1e-6 of the tensor's scale.
                np.testing.assert_allclose(got, want, rtol=1e-4,
                                           atol=2e-6 * float(np.abs(want).max()))
    assert names == len(targets or lora.TARGETS)


def test_a_learner_trains_the_adapters_alone_with_the_base_as_reference():
    graphdef, adapters, frozen = lora.split_trainable(adapted())
    base_before = jax.tree.map(np.asarray, frozen)
    learner = Learner(graphdef, adapters, BASE, frozen=frozen)
    assert learner.state.ref_params is None  # the base is the reference: no copy
    # The optimizer holds moments for the adapters only.
    moments = sum(x.size for x in jax.tree.leaves(learner.state.opt_state))
    adapter_size = sum(x.size for x in jax.tree.leaves(adapters))
    assert adapter_size < moments < 3 * adapter_size + 16
    # The reference's logprobs are the base model's.
    base_learner = Learner(*nnx.split(Transformer(MODEL_CFG, rngs=nnx.Rngs(0))), BASE)
    ref = learner.sample_logprobs(SAMPLES, reference=True)
    want = base_learner.sample_logprobs(SAMPLES, reference=True)
    for r, w in zip(ref, want, strict=True):
        np.testing.assert_allclose(r, w, atol=1e-6)
    metrics = learner.step(SAMPLES, [1e-2])
    assert metrics["actor/grad_norm"] > 0 and metrics["optim/nonfinite_updates"] == 0
    # The base did not move; B did; the reference is still the base.
    for got, want_ in zip(jax.tree.leaves(learner.engine.frozen), jax.tree.leaves(base_before),
                          strict=True):
        np.testing.assert_array_equal(got, want_)
    b_norm = sum(float(jnp.abs(x).sum()) for p, x in
                 jax.tree_util.tree_flatten_with_path(learner.state.params)[0]
                 if "lora_b" in jax.tree_util.keystr(p))
    assert b_norm > 0
    for r, w in zip(learner.sample_logprobs(SAMPLES, reference=True), want, strict=True):
        np.testing.assert_allclose(r, w, atol=1e-6)
    moved = learner.sample_logprobs(SAMPLES)
    assert any(not np.allclose(m, w, atol=1e-6) for m, w in zip(moved, want, strict=True))


def test_lora_settings_are_checked():
    with pytest.raises(ValueError, match="lora_rank: must be an integer >= 0"):
        lora.LoRAConfig(rank=-1)
    with pytest.raises(ValueError, match="lora_targets: unknown projection 'qproj'"):
        lora.LoRAConfig(rank=4, targets=("qproj",))
    assert lora.LoRAConfig(rank=8).scale == 1.0 and lora.LoRAConfig(8, 16.0).scale == 2.0
    assert dataclasses.replace(lora.LoRAConfig(), rank=0).enabled is False


def test_merged_adapters_give_the_adapted_models_logits(tmp_path):
    """The exported checkpoint holds W + s·A·B: `transformers` loads it (no adapter
    tensors) and its logits are the adapted model's to fp32 rounding."""
    import torch
    import transformers

    from jaxrl_agentic.models import save_pretrained

    graphdef, adapters, frozen = with_random_b(adapted(targets=("v_proj", "up_proj")))
    model = nnx.merge(graphdef, lora.combine(adapters, frozen))
    want = np.asarray(model(TOKENS, POSITIONS))
    merged = lora.merge_adapters(model)
    assert not lora.has_lora(merged)
    np.testing.assert_allclose(merged(TOKENS, POSITIONS), want, atol=2e-5)
    save_pretrained(merged, None, str(tmp_path / "hf"))
    hf = transformers.AutoModelForCausalLM.from_pretrained(str(tmp_path / "hf"),
                                                           torch_dtype=torch.float32)
    with torch.no_grad():
        got = hf(torch.as_tensor(np.asarray(TOKENS), dtype=torch.long)).logits.numpy()
    np.testing.assert_allclose(got, want, atol=1e-4)


def test_adapter_count_is_what_add_lora_adds_and_the_plan_trains_only_it():
    from jaxrl_agentic.runtime.memory_plan import memory_plan

    for targets in ((), ("k_proj", "down_proj")):
        config = lora.LoRAConfig(rank=4, targets=targets)
        model = lora.add_lora(Transformer(MODEL_CFG, rngs=nnx.Rngs(0)), config)
        _, adapters, _ = lora.split_trainable(model)
        assert lora.adapter_count(MODEL_CFG, config) == sum(
            x.size for x in jax.tree.leaves(adapters))
    q = lora.adapter_count(MODEL_CFG, lora.LoRAConfig(rank=4))
    common = dict(row_len=64, loss_slots=16, remat="none", kernel_impl="auto", reference=True)
    full, adapted_ = (dict(memory_plan(MODEL_CFG, **common, lora_params=n).items)
                      for n in (0, q))
    p = MODEL_CFG.num_params()
    assert (full["gradients"], full["optimizer"], full["reference"]) == (4 * p, 8 * p, 4 * p)
    assert (adapted_["gradients"], adapted_["optimizer"], adapted_["reference"]) == \
        (4 * q, 8 * q, 0.0)
    assert adapted_["parameters"] == 4 * (p + q)


def test_the_peft_adapter_loads_onto_the_base_and_gives_the_adapted_logits(tmp_path):
    """PEFT round trip: the base saved as a Hugging Face model, the adapters as a PEFT
    directory; `peft` puts them on the base and `transformers` computes the adapted model's
    logits."""


    assert_peft_round_trip(MODEL_CFG, with_random_b(adapted(
        rank=4, alpha=8.0, targets=("q_proj", "o_proj", "up_proj"))), tmp_path)
    with pytest.raises(ValueError, match="no LoRA adapters"):
        save_peft_adapter(Transformer(MODEL_CFG, rngs=nnx.Rngs(0)), str(tmp_path / "x"))


UNTIED = dataclasses.replace(MODEL_CFG, tie_word_embeddings=False)


HEAD = (("lm_head", "kernel"),)
HEAD_AND_EMBEDDING = (("lm_head", "kernel"), ("embed", "embedding"))


def trained_in_full(parts=HEAD, seed=1):
    """An untied model with adapters and the `parts` ((module, variable): the head, and the
    embedding too) trained in full, all moved off their start."""
    config = lora.LoRAConfig(rank=4, alpha=8.0, train_head="always",
                             train_embedding=("embed", "embedding") in parts)
    model = lora.add_lora(Transformer(UNTIED, rngs=nnx.Rngs(0)), config)
    graphdef, adapters, frozen = with_random_b(model, seed)
    pure = nnx.to_pure_dict(adapters)
    for module, name in parts:
        pure[module][name] = pure[module][name] + 0.2 * jax.random.normal(
            jax.random.key(seed + 1 + len(name)), pure[module][name].shape)
    nnx.replace_by_pure_dict(adapters, pure)
    return config, (graphdef, adapters, frozen)


@pytest.mark.parametrize("parts", [HEAD, HEAD_AND_EMBEDDING], ids=["head", "head+embedding"])
def test_what_trains_in_full_trains_beside_the_adapters_and_the_reference_keeps_its_start(
        parts):
    base = Transformer(UNTIED, rngs=nnx.Rngs(0))
    config, (graphdef, adapters, frozen) = trained_in_full(parts)
    for module, name in parts:  # trained, with optimizer state
        assert name in nnx.to_pure_dict(adapters)[module]
    assert lora.adapter_count(UNTIED, config) == sum(x.size for x in jax.tree.leaves(adapters))
    moved = nnx.merge(graphdef, lora.combine(adapters, frozen))
    assert lora.trained_in_full(moved) == list(parts)
    assert not np.allclose(moved(TOKENS, POSITIONS), base(TOKENS, POSITIONS), atol=1e-4)
    np.testing.assert_array_equal(  # the reference: B = 0, each part at its start
        nnx.merge(graphdef, lora.combine(lora.base_only(adapters, frozen), frozen))(
            TOKENS, POSITIONS), base(TOKENS, POSITIONS))
    learner = Learner(graphdef, adapters, BASE, frozen=frozen)
    want = Learner(*nnx.split(base), BASE).sample_logprobs(SAMPLES, reference=True)
    before = nnx.to_pure_dict(adapters)
    learner.step(SAMPLES, [1e-2])
    after = nnx.to_pure_dict(learner.state.params)
    for module, name in parts:  # moved (the embedding's rows of the samples' tokens)
        assert not np.allclose(after[module][name], np.asarray(before[module][name]))
    for r, w in zip(learner.sample_logprobs(SAMPLES, reference=True), want, strict=True):
        np.testing.assert_allclose(r, w, atol=1e-6)
    # Merged, each trained part is the model's own and its start is gone.
    want_logits = np.asarray(moved(TOKENS, POSITIONS))
    merged = lora.merge_adapters(moved)
    assert not lora.trained_in_full(merged)
    for module, name in parts:
        assert isinstance(getattr(getattr(merged, module), name), nnx.Param)
    np.testing.assert_allclose(merged(TOKENS, POSITIONS), want_logits, atol=2e-5)


@pytest.mark.parametrize("parts", [HEAD, HEAD_AND_EMBEDDING], ids=["head", "head+embedding"])
def test_what_trains_in_full_goes_to_peft_as_a_module_to_save(parts, tmp_path):
    assert_peft_round_trip(UNTIED, trained_in_full(parts)[1], tmp_path)


def test_head_training_settings_are_checked():
    with pytest.raises(ValueError, match="lora_train_head: must be one of auto, always"):
        lora.LoRAConfig(rank=4, train_head="yes")
    with pytest.raises(ValueError, match="lora_train_head: the head is tied"):
        lora.add_lora(Transformer(MODEL_CFG, rngs=nnx.Rngs(0)),
                      lora.LoRAConfig(rank=4, train_head="always"))
    assert lora.LoRAConfig(4, untied_head=True).trains_head  # "auto": a head untied here
    assert not lora.LoRAConfig(4).trains_head and not lora.LoRAConfig(
        4, train_head="never", untied_head=True).trains_head


def test_a_tied_embedding_is_not_trained_beside_adapters():
    with pytest.raises(ValueError, match="^lora_train_embedding: the embedding is tied"):
        lora.add_lora(Transformer(MODEL_CFG, rngs=nnx.Rngs(0)),
                      lora.LoRAConfig(rank=4, train_embedding=True))
