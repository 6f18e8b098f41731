"""The learner's update step and logprob recomputation lower for a GPU and for a TPU, checked
on a CPU.

The kernel-level lowering tests (``tests/pallas_kernels/test_lowering.py``) check each
kernel alone. Here the learner is built as it is on an accelerator: JAX's default backend
reads "gpu" (or "tpu") while the ``Learner`` is made and its ``update_step`` traced, so
every "auto" dispatch takes the accelerator's path (Pallas attention and the Triton PPO
kernel on a GPU; splash, the Mosaic logprob and PPO kernels on a TPU), and the step is
lowered with ``lowering_platforms``. A dispatch or integration error on those paths (the
PPO kernel lowering to Mosaic GPU under JAX 0.10, for one) fails here instead of at a
user's first update. Compilation and numbers still need the device.
"""

import importlib
import re

import jax
import numpy as np
import pytest
from flax import nnx

from jaxrl_agentic.data import PackingConfig
from jaxrl_agentic.data.types import Sample
from jaxrl_agentic.models import load_pretrained
from jaxrl_agentic.models.tiny import default_tiny_model_dir
from jaxrl_agentic.training.learner import LOGPROB_BATCH_KEYS, Learner
from jaxrl_agentic.training.learner_config import LearnerConfig
from jaxrl_agentic.training.update import pad_to_shards, put_batch


def _samples(n=8, seed=0):
    rng = np.random.default_rng(seed)
    out = []
    for i in range(n):
        length = int(rng.integers(200, 400))
        mask = np.zeros(length, np.float32)
        mask[length // 2:] = 1.0
        out.append(Sample(tokens=rng.integers(0, 500, length), loss_mask=mask,
                          old_logprobs=np.zeros(length, np.float32),
                          advantages=0.5 * mask, traj_id=i, prompt_len=length // 2))
    return out


GPU_UPDATE = {"segment_attention_fwd", "segment_attention_dq", "segment_attention_dkdv",
              "masked_ppo_loss_fwd", "masked_ppo_loss_bwd"}
TPU_UPDATE = {"splash_mha_fwd_segmented_residuals", "splash_mha_dq_segmented_no_residuals",
              "splash_mha_dkv_segmented_no_residuals", "token_logprobs_fwd",
              "token_logprobs_bwd_dh", "token_logprobs_bwd_dw", "masked_ppo_loss_fwd",
              "masked_ppo_loss_bwd"}


def _kernels(text):
    """Names of the Pallas kernels in a lowered module (``pallas_call(name=...)``)."""
    return set(re.findall(r"(?:segment_attention|masked_ppo_loss|token_logprobs|splash_mha)"
                          r"_[a-z_]+", text))


@pytest.mark.parametrize("backend, platform, attention_impl, update_kernels, recompute_kernels", [
    # GPU: logprobs are the chunked scan (plain JAX), so no logprob kernel.
    ("gpu", "cuda", "auto", GPU_UPDATE, {"segment_attention_fwd"}),
    # cuDNN's packed attention, with the Pallas kernel as its fallback branch.
    ("gpu", "cuda", "cudnn", GPU_UPDATE, {"segment_attention_fwd"}),
    ("tpu", "tpu", "auto", TPU_UPDATE, {"splash_mha_fwd_segmented_no_residuals",
                                        "token_logprobs_fwd"}),
])
def test_update_step_lowers_for_the_accelerator(backend, platform, attention_impl,
                                                update_kernels, recompute_kernels,
                                                monkeypatch):
    model, _ = load_pretrained(default_tiny_model_dir(), dtype="bfloat16",
                               param_dtype="float32")
    graphdef, params = nnx.split(model)
    packing = PackingConfig(micro_batch_max_tokens=1024, sequence_length=1024)
    config = LearnerConfig(learning_rate=1e-5, mini_batch_size=8, packing=packing,
                           attention_impl=attention_impl)
    monkeypatch.setattr(jax, "default_backend", lambda: backend)
    # (the package exports functions of these modules' names, hence import_module)
    for module in ("pallas_kernels.token_logprobs", "pallas_kernels.ppo_loss"):
        monkeypatch.setattr(importlib.import_module(module), "default_platform",
                            lambda: backend)
    if attention_impl == "cudnn":  # cuDNN asks the local GPU; answer as an H100 would
        from jax._src.cudnn import fused_attention_stablehlo as cudnn

        monkeypatch.setattr(cudnn, "check_cudnn_version", lambda: 91000)
        monkeypatch.setattr(cudnn, "check_compute_capability", lambda capability: True)
        monkeypatch.setattr(cudnn, "is_cuda_compute_capability_equal", lambda capability: False)
    try:
        learner = Learner(graphdef, params, config)
        engine = learner.engine
        batch = put_batch(pad_to_shards(packing.pack(_samples()), engine.mesh,
                                        packing.pad_token_id), engine.batch_keys, engine.mesh)
        text = engine.update_step.trace(learner.state, batch, np.float32(1e-5)).lower(
            lowering_platforms=(platform,)).as_text()
        # The logprob recomputation (old and reference logprobs): forward kernels only.
        logprob_batch = put_batch(pad_to_shards(packing.pack(_samples()), engine.mesh,
                                                packing.pad_token_id), LOGPROB_BATCH_KEYS,
                                  engine.mesh)
        recompute = learner.compute_logprobs.trace(learner.state.params, logprob_batch).lower(
            lowering_platforms=(platform,)).as_text()
    finally:
        # Traces made while the backend read "gpu"/"tpu" must not serve later CPU tests of
        # this worker from JAX's caches.
        jax.clear_caches()
    assert _kernels(text) == update_kernels
    assert _kernels(recompute) == recompute_kernels
    cudnn_calls = {"__cudnn$fmhaSoftmax", "__cudnn$fmhaSoftmaxBackward"}
    assert {c for c in cudnn_calls if f"@{c}(" in text} == (
        cudnn_calls if attention_impl == "cudnn" else set())
    assert ("@__cudnn$fmhaSoftmax(" in recompute) == (attention_impl == "cudnn")
