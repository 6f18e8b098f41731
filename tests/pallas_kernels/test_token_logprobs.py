"""Fused logprob/entropy paths against the full-logits reference (and numpy by hand).

Shapes are ragged on purpose: N = 37 tokens with block_n = 16, V = 300 with block_v = 128
(TPU layout) or 64 (GPU layout, which also pads D = 48 to block_d = 32 chunks). Pallas runs in
interpret mode here, where out-of-range block elements read as NaN: any masking slip shows.
"""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from pallas_kernels import (
    choose_blocks,
    pallas_token_logprobs,
    reference_token_logprobs,
    resolve_impl,
    token_logprobs,
)
from pallas_kernels._logprob_pallas import gpu_shared_bytes
from pallas_kernels._softmax_math import matmul_precision

N, D, V, T = 37, 48, 300, 0.7

FUSED = {
    "chunked": lambda h, w, y, **kw: token_logprobs(h, w, y, T, impl="chunked", block_v=128,
                                                    **kw),
    "pallas_tpu": lambda h, w, y, **kw: pallas_token_logprobs(
        h, w, y, T, family="tpu", block_n=16, block_v=128, **kw),
    "pallas_gpu": lambda h, w, y, **kw: pallas_token_logprobs(
        h, w, y, T, family="gpu", block_n=16, block_v=64, block_d=32, vocab_splits=2, **kw),
}


def _reference(h, w, y, **kw):
    return reference_token_logprobs(h, w, y, T, **kw)


@pytest.fixture(scope="module")
def data():
    rng = np.random.default_rng(0)
    return dict(
        h=jnp.asarray(rng.normal(size=(N, D)), jnp.float32),
        w=jnp.asarray(rng.normal(size=(D, V)) * 0.3, jnp.float32),
        y=jnp.asarray(rng.integers(0, V, size=N), jnp.int32),
        g_lp=jnp.asarray(rng.normal(size=N), jnp.float32),
        g_h=jnp.asarray(rng.normal(size=N), jnp.float32),
    )


def _rel(a, b):
    return float(jnp.max(jnp.abs(a.astype(jnp.float32) - b)) / jnp.max(jnp.abs(b)))


def _grad_fn(fn, y, g_lp, g_h):
    """value_and_grad over (hidden, W) of Σ g_lp·logprob (+ Σ g_h·entropy)."""

    def loss(h, w):
        if g_h is None:
            return jnp.sum(g_lp * fn(h, w, y))
        lp, ent = fn(h, w, y, return_entropy=True)
        return jnp.sum(g_lp * lp) + jnp.sum(g_h * ent)

    return jax.jit(jax.value_and_grad(loss, argnums=(0, 1)))


def test_reference_matches_numpy_by_hand():
    # Logits [0, ln 3] → p = [1/4, 3/4]; target 1.
    h = jnp.asarray([[1.0, 1.0]])
    w = jnp.asarray([[0.0, np.log(3.0)], [0.0, 0.0]], jnp.float32)
    lp, ent = reference_token_logprobs(h, w, jnp.asarray([1]), return_entropy=True)
    np.testing.assert_allclose(lp, [np.log(0.75)], atol=1e-6)
    np.testing.assert_allclose(ent, [-(0.25 * np.log(0.25) + 0.75 * np.log(0.75))], atol=1e-6)

    rng = np.random.default_rng(1)
    h64, w64 = rng.normal(size=(5, 6)), rng.normal(size=(6, 11))
    y = rng.integers(0, 11, size=5)
    z = h64 @ w64 / T
    log_p = z - np.log(np.exp(z).sum(axis=1, keepdims=True))
    lp, ent = reference_token_logprobs(jnp.asarray(h64, jnp.float32),
                                       jnp.asarray(w64, jnp.float32), jnp.asarray(y), T,
                                       return_entropy=True)
    np.testing.assert_allclose(lp, log_p[np.arange(5), y], atol=1e-5)
    np.testing.assert_allclose(ent, -(np.exp(log_p) * log_p).sum(axis=1), atol=1e-5)


@pytest.mark.parametrize("impl", sorted(FUSED))
def test_logprobs_and_entropy_match_reference(data, impl):
    lp, ent = jax.jit(lambda h, w, y: FUSED[impl](h, w, y, return_entropy=True))(
        data["h"], data["w"], data["y"])
    ref_lp, ref_ent = _reference(data["h"], data["w"], data["y"], return_entropy=True)
    assert lp.shape == ent.shape == (N,) and lp.dtype == ent.dtype == jnp.float32
    np.testing.assert_allclose(lp, ref_lp, atol=1e-5, rtol=0)
    np.testing.assert_allclose(ent, ref_ent, atol=1e-5, rtol=0)


@pytest.mark.parametrize("impl", sorted(FUSED))
def test_gradients_through_logprobs_and_entropy(data, impl):
    args = (data["y"], data["g_lp"], data["g_h"])
    value, (dh, dw) = _grad_fn(FUSED[impl], *args)(data["h"], data["w"])
    ref_value, (ref_dh, ref_dw) = _grad_fn(_reference, *args)(data["h"], data["w"])
    np.testing.assert_allclose(value, ref_value, rtol=1e-5, atol=1e-4)  # sum of N terms
    assert _rel(dh, ref_dh) <= 1e-4
    assert _rel(dw, ref_dw) <= 1e-4


@pytest.mark.parametrize("impl", sorted(FUSED))
def test_gradients_logprobs_only(data, impl):
    args = (data["y"], data["g_lp"], None)
    value, (dh, dw) = _grad_fn(FUSED[impl], *args)(data["h"], data["w"])
    ref_value, (ref_dh, ref_dw) = _grad_fn(_reference, *args)(data["h"], data["w"])
    np.testing.assert_allclose(value, ref_value, rtol=1e-5, atol=1e-4)  # sum of N terms
    assert _rel(dh, ref_dh) <= 1e-4
    assert _rel(dw, ref_dw) <= 1e-4


@pytest.mark.parametrize("impl", ["chunked", "pallas_tpu"])
def test_unused_entropy_adds_no_gradient(data, impl):
    # Entropy returned (e.g. for logging) but not in the loss: its cotangent is a symbolic
    # zero and the gradient must equal the logprob-only one.
    def loss(h, w):
        lp, _ = FUSED[impl](h, w, data["y"], return_entropy=True)
        return jnp.sum(data["g_lp"] * lp)

    dh, dw = jax.jit(jax.grad(loss, argnums=(0, 1)))(data["h"], data["w"])
    _, (ref_dh, ref_dw) = _grad_fn(_reference, data["y"], data["g_lp"], None)(data["h"],
                                                                              data["w"])
    assert _rel(dh, ref_dh) <= 1e-4
    assert _rel(dw, ref_dw) <= 1e-4


# bf16 operands: products are exact in fp32 and the softmax runs in fp32, so logprobs and
# entropy match the fp32 reference on the same (bf16-rounded) values to summation order
# (observed ~1e-6). Gradients are rounded to bf16 and dlogits enter the backward matmuls as
# bf16 (observed ~3e-3 relative; the bf16 reference itself is ~2e-3 off): ≤ 1e-2 relative.
BF16_VALUE_ATOL = 1e-5
BF16_GRAD_RTOL = 1e-2


@pytest.mark.parametrize("impl", sorted(FUSED))
def test_bf16_inputs(data, impl):
    h, w = data["h"].astype(jnp.bfloat16), data["w"].astype(jnp.bfloat16)
    args = (data["y"], data["g_lp"], data["g_h"])
    _, (dh, dw) = _grad_fn(FUSED[impl], *args)(h, w)
    assert dh.dtype == dw.dtype == jnp.bfloat16
    h32, w32 = h.astype(jnp.float32), w.astype(jnp.float32)
    _, (ref_dh, ref_dw) = _grad_fn(_reference, *args)(h32, w32)
    assert _rel(dh, ref_dh) <= BF16_GRAD_RTOL
    assert _rel(dw, ref_dw) <= BF16_GRAD_RTOL

    lp, ent = jax.jit(lambda h, w: FUSED[impl](h, w, data["y"], return_entropy=True))(h, w)
    ref_lp, ref_ent = _reference(h32, w32, data["y"], return_entropy=True)
    np.testing.assert_allclose(lp, ref_lp, atol=BF16_VALUE_ATOL, rtol=0)
    np.testing.assert_allclose(ent, ref_ent, atol=BF16_VALUE_ATOL, rtol=0)


def test_auto_dispatch():
    assert resolve_impl("auto", "cpu") == "chunked"
    assert resolve_impl("auto", "tpu") == "pallas"
    # The Triton kernel measured 5–8× slower than the GEMMs "chunked" is made of (H200).
    assert resolve_impl("auto", "gpu") == "chunked"
    assert resolve_impl("reference", "tpu") == "reference"
    with pytest.raises(ValueError, match="unknown impl"):
        resolve_impl("fast")


def test_auto_on_cpu_matches_reference(data):
    lp = jax.jit(lambda h, w, y: token_logprobs(h, w, y, T))(data["h"], data["w"], data["y"])
    np.testing.assert_allclose(lp, _reference(data["h"], data["w"], data["y"]), atol=1e-5)


def test_chunked_never_holds_full_logits():
    n, d, v = 64, 32, 8192
    h, w = jnp.ones((n, d)), jnp.ones((d, v))
    y = jnp.zeros((n,), jnp.int32)

    def temp_bytes(impl):
        grad = jax.jit(jax.grad(
            lambda h, w: token_logprobs(h, w, y, impl=impl, block_v=1024).sum(), argnums=(0, 1)))
        return grad.lower(h, w).compile().memory_analysis().temp_size_in_bytes

    logits_bytes = n * v * 4
    assert temp_bytes("reference") >= logits_bytes
    assert temp_bytes("chunked") < logits_bytes // 4


@pytest.mark.parametrize("n,d,v,dtype", [
    (37, 48, 300, jnp.float32), (4096, 896, 151936, jnp.bfloat16),
    (5, 4096, 128256, jnp.float32), (1000, 4096, 128256, jnp.bfloat16),
])
def test_block_choice_respects_hardware_rules(n, d, v, dtype):
    tpu = choose_blocks(n, d, v, dtype, "tpu")
    sublane = 16 if dtype == jnp.bfloat16 else 8
    assert tpu.block_n % sublane == 0 and tpu.block_v % 128 == 0
    assert 0 < tpu.block_n <= 256 and 128 <= tpu.block_v <= 2048

    gpu = choose_blocks(n, d, v, dtype, "gpu")
    for size in (gpu.block_n, gpu.block_v, gpu.block_d):
        assert size >= 16 and size & (size - 1) == 0
    assert d % gpu.block_d == 0  # all these D have a power-of-two divisor ≥ 16

    chunked = choose_blocks(n, d, v, dtype, "chunked")
    assert 1 <= chunked.block_v <= min(v, 32768)


@pytest.mark.parametrize("d", [64, 896, 1536, 2048, 3584, 4096, 8192])
@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16])
def test_gpu_blocks_fit_shared_memory(d, dtype):
    """The GPU kernels' D loop must fit shared memory at every real hidden size. Before it
    was a loop, all D chunks were live at once: Qwen2.5-0.5B (D = 896, fp32, 7 chunks of
    128) asked an H200 for 1,146,880 bytes of its 232,448 and the learner could not start."""
    blocks = choose_blocks(4096, d, 151936, dtype, "gpu")
    itemsize = jnp.dtype(dtype).itemsize
    used = gpu_shared_bytes(blocks.block_n, blocks.block_v, blocks.block_d, itemsize)
    assert used <= 96 * 2**10 < 232_448
    # The estimate reproduces the H200's figure for the unrolled loop (7 chunks live).
    assert gpu_shared_bytes(64, 128, 128, 4, stages=896 // 128) == 1_146_880


def _sub_jaxprs(eqn):
    for value in eqn.params.values():
        for x in value if isinstance(value, (tuple, list)) else (value,):
            if hasattr(x, "eqns"):
                yield x
            elif hasattr(getattr(x, "jaxpr", None), "eqns"):
                yield x.jaxpr


def _static_dots(jaxpr) -> int:
    """dot_general equations in a jaxpr, each loop body counted once."""
    return sum((e.primitive.name == "dot_general") + sum(map(_static_dots, _sub_jaxprs(e)))
               for e in jaxpr.eqns)


def _kernel_dots(jaxpr, found=None) -> dict[str, int]:
    found = {} if found is None else found
    for e in jaxpr.eqns:
        if e.primitive.name == "pallas_call":
            params = e.params
            name = str(params.get("name_and_src_info", params.get("name"))).split()[0]
            found[name] = _static_dots(e.params["jaxpr"])
        for sub in _sub_jaxprs(e):
            _kernel_dots(sub, found)
    return found


@pytest.mark.parametrize("d", [128, 896])
def test_gpu_kernels_loop_over_d_instead_of_unrolling(d):
    """The GPU kernels' code (and so their shared memory) must not grow with D: one matmul
    in the forward, three in the backward (recompute, dh, dW), each inside the D loop. The
    unrolled version had 28 and 84 at D = 896 (fp32, block_d 32)."""
    h, w = jnp.ones((64, d)), jnp.ones((d, 256))
    y = jnp.zeros((64,), jnp.int32)

    def loss(h, w):
        return jnp.sum(pallas_token_logprobs(h, w, y, T, family="gpu", interpret=True))

    jaxpr = jax.make_jaxpr(jax.grad(loss, argnums=(0, 1)))(h, w).jaxpr
    assert _kernel_dots(jaxpr) == {"token_logprobs_fwd_gpu": 1, "token_logprobs_bwd_gpu": 3}


def test_fp32_kernel_precision_follows_config_and_gpu_default(monkeypatch):
    """fp32 kernel matmuls: full fp32 on CPU/TPU; TF32 on a GPU, as XLA runs the rest of the
    model there (full fp32 Triton dots measured 27x slower, docs/benchmarks.md); whatever
    jax_default_matmul_precision names when set. Low precision operands: DEFAULT."""
    hi, high, default = (jax.lax.Precision.HIGHEST, jax.lax.Precision.HIGH,
                         jax.lax.Precision.DEFAULT)
    assert matmul_precision(jnp.float32) == hi  # this CPU
    assert matmul_precision(jnp.bfloat16) == default
    with jax.default_matmul_precision("tensorfloat32"):
        assert matmul_precision(jnp.float32) == high
    monkeypatch.setattr(jax, "default_backend", lambda: "gpu")
    assert matmul_precision(jnp.float32) == high
    with jax.default_matmul_precision("highest"):
        assert matmul_precision(jnp.float32) == hi
    assert matmul_precision(jnp.bfloat16) == default


def test_rejects_bad_arguments(data):
    h, w, y = data["h"], data["w"], data["y"]
    with pytest.raises(ValueError, match="TPU blocks"):
        pallas_token_logprobs(h, w, y, family="tpu", block_v=100)
    with pytest.raises(ValueError, match="powers of two"):
        pallas_token_logprobs(h, w, y, family="gpu", block_n=24)
    with pytest.raises(ValueError, match="lm_head"):
        token_logprobs(h, w.T, y)
    with pytest.raises(ValueError, match="targets"):
        token_logprobs(h, w, y[:-1])
    with pytest.raises(ValueError, match="temperature"):
        token_logprobs(h, w, y, 0.0)
