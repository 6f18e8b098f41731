"""The accelerator kernels lower for their hardware, checked on a CPU.

``jit(...).trace(...).lower(lowering_platforms=(...))`` runs JAX's lowering for a backend
that is not present: Pallas emits the Triton (GPU) or Mosaic (TPU) kernel into the module,
and the cuDNN wrapper emits its custom calls. What this catches without a device: a kernel
whose block shapes or operations its backend's Pallas lowering rejects, a change in JAX's
private cuDNN API (``_cudnn_attention``), a dispatch that silently stopped reaching a
kernel. What it cannot catch: anything decided when the backend compiles the kernel
(shared memory, registers, Mosaic's layout passes) and the numbers; those need a device
(``scripts/bench/gpu_kernel_check.py``, ``gpu_session.sh``). Shapes are the Qwen2.5-0.5B
heads and hidden size (14 query heads, 2 kv heads, head_dim 64, D = 896, V = 151,936 for
the LM head), which the tiny model's tests never reach.
"""

import re

import jax
import jax.numpy as jnp
import pytest

from pallas_kernels import masked_ppo_loss, pallas_token_logprobs
from pallas_kernels._cudnn_attention import cudnn_segment_attention
from pallas_kernels._flash_attention_pallas import pallas_segment_attention, triton_block
from pallas_kernels._splash_attention import splash_segment_attention
from tests.pallas_kernels.attention_cases import tree_batch

TRITON = "__gpu$xla.gpu.triton"
MOSAIC = "tpu_custom_call"


def _lowered(fn, *args, platform):
    return jax.jit(fn).trace(*args).lower(lowering_platforms=(platform,)).as_text()


def _custom_calls(text):
    return re.findall(r'custom_call @?"?([\w$.]+)', text) + re.findall(
        r'call_target_name = "([^"]+)"', text)


def _qkv(dtype, length=512, heads=14, kv_heads=2, head_dim=64):
    q = jnp.zeros((2, length, heads, head_dim), dtype)
    k = jnp.zeros((2, length, kv_heads, head_dim), dtype)
    seg = jnp.ones((2, length), jnp.int32)
    return q, k, seg


def _attention_grad(attend, seg):
    def loss(q, k, v):
        return jnp.sum(attend(q, k, v, seg).astype(jnp.float32))
    return jax.grad(loss, argnums=(0, 1, 2))


@pytest.mark.parametrize("dtype", [jnp.bfloat16, jnp.float32])
@pytest.mark.parametrize("dkdv_grid", ["kv_heads", "query_heads"])
def test_segment_attention_kernel_lowers_to_triton(dtype, dkdv_grid):
    q, k, seg = _qkv(dtype)
    block = triton_block(dtype, q.shape[-1])

    def attend(q, k, v, seg):
        return pallas_segment_attention(q, k, v, seg, block_q=block, block_k=block,
                                        dkdv_grid=dkdv_grid)

    text = _lowered(_attention_grad(attend, seg), q, k, k, platform="cuda")
    assert text.count(TRITON) == 3  # forward, dq, dk/dv


def _tree_ids(batch=2):
    """Segment and prefix ids of the first ``batch`` tree-packed rows of 512 tokens."""
    return tuple(jnp.asarray(x[:batch]) for x in tree_batch(512))


@pytest.mark.parametrize("dtype,dkdv_grid", [(jnp.bfloat16, "kv_heads"),
                                             (jnp.float32, "query_heads")])
def test_tree_segment_attention_kernel_lowers_to_triton(dtype, dkdv_grid):
    """With prefix ids: the prefix input and the forward's and dq's two key-block loops."""
    q, k, _ = _qkv(dtype)
    seg, pre = _tree_ids()
    block = triton_block(dtype, q.shape[-1])

    def attend(q, k, v, seg):
        return pallas_segment_attention(q, k, v, seg, prefix_ids=pre, block_q=block,
                                        block_k=block, dkdv_grid=dkdv_grid)

    text = _lowered(_attention_grad(attend, seg), q, k, k, platform="cuda")
    assert text.count(TRITON) == 3  # forward, dq, dk/dv


@pytest.mark.parametrize("family, platform, marker", [("gpu", "cuda", TRITON),
                                                      ("tpu", "tpu", MOSAIC)])
@pytest.mark.parametrize("dtype", [jnp.bfloat16, jnp.float32])
def test_logprob_kernels_lower_at_the_qwen_head(family, platform, marker, dtype):
    h = jnp.zeros((512, 896), dtype)
    w = jnp.zeros((896, 151936), dtype)
    y = jnp.zeros((512,), jnp.int32)

    def loss(h, w):
        return jnp.sum(pallas_token_logprobs(h, w, y, 1.0, family=family, interpret=False))

    text = _lowered(jax.grad(loss, argnums=(0, 1)), h, w, platform=platform)
    # GPU: one forward kernel, one fused backward; TPU: forward, dh and dW.
    assert text.count(marker) == (2 if family == "gpu" else 3)


@pytest.mark.parametrize("platform, marker", [("cuda", TRITON), ("tpu", MOSAIC)])
def test_ppo_loss_kernel_lowers(platform, marker, monkeypatch):
    """The kernel is traced with the accelerator as JAX's default backend, so it reads the
    platform there; on a GPU it must name Triton (``_PPOConfig.compiler_params``): left
    unnamed, JAX 0.10 picks Mosaic GPU, which cannot lower it."""
    monkeypatch.setattr("pallas_kernels.ppo_loss.default_platform",
                        lambda: "gpu" if platform == "cuda" else platform)
    n = 1024
    logp = jnp.zeros((n,), jnp.float32)

    def loss(logp):
        sums = masked_ppo_loss(logp, logp, logp, jnp.ones((n,), jnp.float32), logp,
                               impl="pallas", interpret=False)
        return sums.pg_loss + sums.kl

    text = _lowered(jax.grad(loss), logp, platform=platform)
    assert text.count(marker) >= 2  # forward sums and the backward


def test_splash_attention_lowers_to_mosaic():
    q, k, seg = _qkv(jnp.bfloat16)
    text = _lowered(_attention_grad(lambda *a: splash_segment_attention(*a), seg), q, k, k,
                    platform="tpu")
    assert text.count(MOSAIC) >= 3  # forward, dq, dk/dv


def test_splash_tree_attention_lowers_to_mosaic():
    q, k, _ = _qkv(jnp.bfloat16)
    seg, pre = _tree_ids()

    def attend(q, k, v, seg):
        return splash_segment_attention(q, k, v, seg, prefix_ids=pre)

    text = _lowered(_attention_grad(attend, seg), q, k, k, platform="tpu")
    # Two passes (own segment, prefix): splash's jitted forward is one function called
    # twice, and each pass has its own dq and dk/dv kernels.
    assert text.count("call @_splash_attention(") == 2
    assert text.count(MOSAIC) == 5
    names = re.findall(r'splash_mha_\w+', text)
    assert names.count("splash_mha_dq_segmented_no_residuals") == 2
    assert names.count("splash_mha_dkv_segmented_no_residuals") == 2


def test_cudnn_packed_attention_lowers_with_its_fallback(monkeypatch):
    """JAX's private cuDNN API, as the installed JAX has it: the packed layout's custom calls
    with 64 segments a row and the padding-causal mask, and the Pallas kernel beside them
    (the fallback branch). cuDNN's own checks ask the local GPU for its version and compute
    capability; here they answer as an H100 with cuDNN 9.10 would."""
    from jax._src.cudnn import fused_attention_stablehlo as cudnn

    monkeypatch.setattr(cudnn, "check_cudnn_version", lambda: 91000)
    monkeypatch.setattr(cudnn, "check_compute_capability", lambda capability: True)
    monkeypatch.setattr(cudnn, "is_cuda_compute_capability_equal", lambda capability: False)
    q, k, seg = _qkv(jnp.bfloat16)
    block = triton_block(q.dtype, q.shape[-1])

    def fallback(q, k, v, seg):
        return pallas_segment_attention(q, k, v, seg, block_q=block, block_k=block)

    text = _lowered(_attention_grad(
        lambda *a: cudnn_segment_attention(*a, fallback=fallback), seg), q, k, k,
        platform="cuda")
    assert "__cudnn$fmhaSoftmax" in text and "__cudnn$fmhaSoftmaxBackward" in text
    # The backend config is JSON inside an MLIR string: its quotes print as \22.
    assert '"max_seg_per_batch": 64' in text.replace("\\22", '"')
    assert '"mask_type": "PADDING_CAUSAL"' in text.replace("\\22", '"')
    assert text.count(TRITON) == 3
