"""The memory plan against independent counts: Qwen2.5-0.5B's published parameter count,
the residuals JAX itself keeps for the learner's backward, hand arithmetic."""

import dataclasses

import jax
import numpy as np
import pytest
from flax import nnx
from jax._src.ad_checkpoint import saved_residuals

from jaxrl_agentic.data import Sample, pack_samples
from jaxrl_agentic.models.config import ModelConfig
from jaxrl_agentic.models.qwen_fixture import qwen25_config
from jaxrl_agentic.models.transformer import Transformer
from jaxrl_agentic.runtime.memory_plan import (
    GIB,
    check_memory_plan,
    layer_activation_bytes,
    memory_plan,
)
from jaxrl_agentic.training.learner import micro_batch_sums
from jaxrl_agentic.training.learner_config import LearnerConfig


def test_training_state_of_qwen2_5_0_5b_is_sixteen_bytes_a_parameter():
    cfg = qwen25_config()
    assert cfg.num_params() == 494_032_768  # Qwen2.5-0.5B's model card: 0.49 B
    plan = dict(memory_plan(cfg, row_len=2048, loss_slots=512, remat="layer",
                            kernel_impl="auto", reference=False).items)
    # fp32 parameters, fp32 gradients, AdamW's two fp32 moments: 16 bytes per parameter,
    # 7.9 GB at Qwen2.5-0.5B; bf16 parameters and moments: 4 + 2 + 4 = 10.
    assert plan["parameters"] + plan["gradients"] + plan["optimizer"] == 16 * 494_032_768
    bf16 = memory_plan(dataclasses.replace(cfg, param_dtype="bfloat16", dtype="bfloat16"),
                       row_len=2048, loss_slots=512, remat="layer", kernel_impl="auto",
                       reference=True, shards=2).training_state
    assert bf16 == (2 + 2 + 4 + 4) * 494_032_768 / 2
    # The LM head at 512 loss slots in 8192-token chunks: 512 · 8192 · 4 B · 3.
    assert plan["lm head"] == 512 * 8192 * 12


def test_a_distillation_teacher_counts_its_matrices_in_its_compute_dtype():
    """Qwen2.5-0.5B distilling from a teacher of the same shape computing in bf16: its
    494,032,768 parameters at 2 bytes, split over 2 shards, part of the training state."""
    cfg = qwen25_config()
    args = dict(row_len=2048, loss_slots=512, remat="layer", kernel_impl="auto",
                reference=False, shards=2)
    without = memory_plan(cfg, **args)
    plan = memory_plan(cfg, teacher=dataclasses.replace(cfg, dtype="bfloat16"), **args)
    assert dict(plan.items)["teacher"] == 2 * 494_032_768 / 2
    assert plan.training_state - without.training_state == 494_032_768
    assert dict(without.items)["teacher"] == 0


def test_a_critic_holds_its_own_backbone_and_moments():
    """GAE's value model: a copy of Qwen2.5-0.5B's 494,032,768 fp32 parameters and their
    two Adam moments, over 2 shards (its gradients live only in its own update step)."""
    cfg = qwen25_config()
    args = dict(row_len=2048, loss_slots=512, remat="layer", kernel_impl="auto",
                reference=False, shards=2)
    plan, without = memory_plan(cfg, critic=True, **args), memory_plan(cfg, **args)
    assert dict(plan.items)["critic"] == 3 * 4 * 494_032_768 / 2
    assert plan.training_state - without.training_state == 3 * 4 * 494_032_768 / 2


def test_on_a_tpu_the_optimizer_update_holds_two_fp32_copies_of_what_trains():
    """Qwen2.5-0.5B over fsdp 4: 2 · P/4 · 4 bytes on a TPU (what XLA:TPU's temporaries
    showed beyond the other items), none on CPU; with LoRA, the adapters' values."""
    cfg = qwen25_config()
    args = dict(row_len=2048, loss_slots=512, remat="layer", kernel_impl="auto",
                reference=False, shards=4)
    tpu, cpu = (dict(memory_plan(cfg, platform=p, **args).items) for p in ("tpu", "cpu"))
    assert tpu["update"] == 2 * 494_032_768 / 4 * 4 and cpu["update"] == 0
    lora = dict(memory_plan(cfg, platform="tpu", lora_params=1000, **args).items)
    assert lora["update"] == 2 * 1000 * 4
    assert tpu["parameters"] == cpu["parameters"]  # not resident state


def test_a_context_axis_splits_each_rows_activations_and_loss_slots():
    """Qwen2.5-0.5B, 8,192-token rows under remat="layer", the context axis C = 4: a device's
    activations are those of 2,048 tokens plus one layer's keys and values of the whole row
    (2 kv heads × 64, bf16), gathered, and their gradients; its LM-head slots at most its
    2,048 tokens. By hand from `layer_activation_bytes`."""
    cfg = dataclasses.replace(qwen25_config(), dtype="bfloat16")
    args = dict(row_len=8192, loss_slots=4096, remat="layer", kernel_impl="auto",
                reference=False, attention_impl="blocksparse")
    whole, split = (dict(memory_plan(cfg, context=c, **args).items) for c in (1, 4))
    own = 2 * cfg.num_hidden_layers * 2048 * cfg.hidden_size * 2 + layer_activation_bytes(
        cfg, 2048, "blocksparse")
    gathered = 2 * 8192 * 2 * 2 * 64 * 2
    assert split["activations"] == own + gathered
    assert split["activations"] < whole["activations"] / 3
    assert (whole["lm head"], split["lm head"]) == (4096 * 8192 * 12, 2048 * 8192 * 12)
    assert split["parameters"] == whole["parameters"]  # the state is not split by it


@pytest.mark.parametrize("remat", ["none", "layer", "dots"])
@pytest.mark.parametrize("row_len", [128, 384])
def test_activation_estimate_bounds_what_jax_keeps_for_the_backward(remat, row_len):
    cfg = ModelConfig(vocab_size=64, hidden_size=32, intermediate_size=96, num_hidden_layers=3,
                      num_attention_heads=4, num_key_value_heads=2, head_dim=8)
    graphdef, params = nnx.split(Transformer(cfg, rngs=nnx.Rngs(0)))
    mask = np.r_[np.zeros(16), np.ones(row_len - 16)]
    samples = [Sample(tokens=np.random.default_rng(0).integers(1, 64, row_len), loss_mask=mask,
                      old_logprobs=-4 * mask, advantages=mask, prompt_len=16)]
    arrays = pack_samples(samples, micro_batch_max_tokens=row_len, sequence_length=row_len,
                          loss_slots=row_len, num_rows=1).device_arrays()
    config = LearnerConfig(remat=remat)
    kept = sum(a.size * a.dtype.itemsize for a, _ in saved_residuals(
        lambda p: micro_batch_sums(graphdef, config, p, arrays, 0.0)[0].objective, params))
    plan = dict(memory_plan(cfg, row_len=row_len, loss_slots=row_len, remat=remat,
                            kernel_impl="auto", reference=False).items)
    estimate = plan["activations"] + plan["lm head"] + plan["parameters"]
    # With remat the one block being recomputed is transient, not a residual.
    transient = 0 if remat == "none" else layer_activation_bytes(cfg, row_len)
    # Errs high (the parameters are residuals too), but not absurdly.
    assert kept <= estimate
    assert estimate - transient <= 4 * kept + 4 * plan["parameters"], (kept, plan)


def test_the_accumulator_is_counted_only_when_a_mini_batch_can_span_groups():
    """One fp32 gradient copy more when the update accumulates over groups of rows
    (`tests/training/test_update_memory.py` measures both cases); the pipeline decides from the
    mini-batch size and the longest sample a row can take."""
    cfg = qwen25_config()
    args = dict(row_len=2048, loss_slots=512, remat="layer", kernel_impl="auto",
                reference=False)
    many = dict(memory_plan(cfg, **args).items)
    one = dict(memory_plan(cfg, accumulates=False, **args).items)
    assert many["accumulator"] == 4 * cfg.num_params() and one["accumulator"] == 0
    assert many["gradients"] == one["gradients"] == 4 * cfg.num_params()


def test_over_budget_plans_say_what_to_change():
    seven_b = ModelConfig(vocab_size=152_064, hidden_size=3584, intermediate_size=18_944,
                          num_hidden_layers=28, num_attention_heads=28, num_key_value_heads=4,
                          head_dim=128, attention_bias=True)
    plan = memory_plan(seven_b, row_len=4096, loss_slots=1024, remat="none",
                       kernel_impl="auto", reference=True, budget=24 * GIB)
    with pytest.raises(ValueError, match="^the parameters, gradients and optimizer state need"
                                         r" 1\d\d\.\d GiB per device.*mesh.fsdp") as e:
        check_memory_plan(plan)
    assert "\n" not in str(e.value)
    small = qwen25_config()
    plan = memory_plan(small, row_len=8192, loss_slots=2048, remat="none", kernel_impl="auto",
                       reference=False, budget=24 * GIB)
    warnings = []
    check_memory_plan(plan, warn=warnings.append)
    assert len(warnings) == 1 and "remat='layer'" in warnings[0]
    fits = memory_plan(small, row_len=2048, loss_slots=512, remat="layer", kernel_impl="auto",
                       reference=False, budget=24 * GIB)
    check_memory_plan(fits, warn=warnings.append)
    assert len(warnings) == 1 and fits.total < 14 * GIB
    assert "memory plan" in fits.table() and "activations" in fits.table()


def test_a_run_whose_state_cannot_fit_fails_before_loading_weights(monkeypatch, tmp_path):
    """The CLI's one-line error, before the model is read or warmed up."""
    from jaxrl_agentic import train
    from jaxrl_agentic.runtime import memory_plan as plan_module

    monkeypatch.setattr(plan_module, "device_budget", lambda: 1024.0)
    assert train.main(["train", f"--config.output_dir={tmp_path}", "--config.max_steps=1"]) == 2
    assert jax.device_count() >= 1
