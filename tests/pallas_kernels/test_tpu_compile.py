"""The Pallas kernels compile for a TPU slice, checked on a machine without a TPU.

With libtpu installed (``pip install "jax[tpu]"`` in an environment of its own; docs/tpu.md,
"Compile for a TPU without one"), ``jax.experimental.topologies`` describes the chips of a
TPU topology and XLA's TPU compiler compiles programs for them ahead of time, Mosaic's own
passes included: what ``test_lowering.py`` cannot check, since it stops at lowering. Each
program is traced on the CPU host under a ``Mesh`` of the four chips of a v5e:2x2 and of a
v5p:2x2x1 (each test on both), as the learner traces its steps, and calls the kernels
through their public entry points with no ``interpret`` argument, so it also checks that a
program compiled for a TPU holds the Mosaic kernels and not their interpreted (CPU) form.
Skipped where libtpu is missing: the test extra does not install it.
"""

import os

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.experimental import topologies
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

from pallas_kernels import masked_ppo_loss, token_logprobs
from pallas_kernels.segment_attention import segment_attention
from tests.pallas_kernels.attention_cases import tree_batch

os.environ.setdefault("TPU_WORKER_HOSTNAMES", "localhost")  # no TPU VM metadata here
TOPOLOGIES = ("v5e:2x2", "v5p:2x2x1")  # four chips each
try:
    topologies.get_topology_desc(platform="tpu", topology_name=TOPOLOGIES[0])
except RuntimeError as err:  # "JAX TPU support not installed"
    pytest.skip(f"no TPU compiler here (libtpu is not installed): {err}",
                allow_module_level=True)

MOSAIC = "tpu_custom_call"


@pytest.fixture(scope="module", params=TOPOLOGIES)
def mesh(request):
    chips = topologies.get_topology_desc(platform="tpu", topology_name=request.param).devices
    assert len(chips) == 4
    return Mesh(np.array(chips), ("data",))


def _rows(mesh):
    return NamedSharding(mesh, P("data"))


@pytest.fixture(autouse=True, scope="module")
def _not_in_the_persistent_cache():
    """Nothing of this module is written to the suite's compilation cache (conftest): an
    executable compiled without a TPU client cannot be read back from it."""
    option = "jax_persistent_cache_min_compile_time_secs"
    before = getattr(jax.config, option)
    jax.config.update(option, float("inf"))
    yield
    jax.config.update(option, before)


def _compiled(mesh, fn, *operands):
    """``fn`` compiled for the four chips; operands are (shape, dtype, sharding)."""
    shapes = [jax.ShapeDtypeStruct(s, d, sharding=sh) for s, d, sh in operands]
    with jax.set_mesh(mesh):
        return jax.jit(fn).trace(*shapes).lower().compile()


def _kernels(compiled) -> int:
    return compiled.as_text().count(MOSAIC)


def _logprob_operands(mesh, n, d, v):
    return (((n, d), jnp.bfloat16, NamedSharding(mesh, P("data", None))),
            ((d, v), jnp.bfloat16, NamedSharding(mesh, P())), ((n,), jnp.int32, _rows(mesh)))


def test_logprob_kernel_compiles(mesh):
    """Forward: one Mosaic kernel; gradient of logprobs and entropy: forward, dh and dW.
    512 tokens a chip, blocks of 128 tokens × 1024 columns, a vocabulary that is not a
    multiple of the block (the ragged last block, as at Qwen's 151,936)."""
    operands = _logprob_operands(mesh, 2048, 128, 16_000)

    def forward(h, w, y):
        return token_logprobs(h, w, y, impl="pallas", block_n=128, block_v=1024)

    def loss(h, w, y):
        logprobs, entropy = token_logprobs(h, w, y, return_entropy=True, impl="pallas",
                                           block_n=128, block_v=1024)
        return jnp.sum(logprobs) + jnp.sum(entropy)

    assert _kernels(_compiled(mesh, forward, *operands)) == 1
    assert _kernels(_compiled(mesh, jax.grad(loss, argnums=(0, 1)), *operands)) == 3


def test_logprob_gradient_needs_less_memory_than_the_full_logits(mesh):
    """The gradient for 2,048 bf16 tokens against the Qwen2.5-0.5B head (896 × 151,936) at
    the kernels' own blocks: its temporaries are below the full-logits reference's and hold
    no fp32 copy of the head. Compiled for a TPU from a CPU host, the kernels once ran
    interpreted (1,302 MiB a chip against the reference's 816 MiB), and then, compiled, their
    dW left the kernel in fp32 (519 MiB)."""
    d, v = 896, 151_936
    operands = _logprob_operands(mesh, 2048, d, v)

    def temporaries(impl):
        def loss(h, w, y):
            return jnp.sum(token_logprobs(h, w, y, impl=impl))
        compiled = _compiled(mesh, jax.grad(loss, argnums=(0, 1)), *operands)
        return compiled.memory_analysis().temp_size_in_bytes, _kernels(compiled)

    (fused, kernels), (reference, _) = temporaries("pallas"), temporaries("reference")
    assert fused < reference
    assert kernels == 3
    assert fused < 4 * d * v


def test_ppo_loss_kernel_compiles(mesh):
    n = 8192  # 2048 tokens per chip: two blocks of 8 × 128
    operands = [((n,), jnp.float32, _rows(mesh))] * 5

    def loss(logp, old, adv, w, ref):
        sums = masked_ppo_loss(logp, old, adv, w, ref, impl="pallas", block_rows=8)
        return sums.pg_loss + sums.kl

    # The forward sums and the backward (value_and_grad: grad alone drops the forward).
    assert _kernels(_compiled(mesh, jax.value_and_grad(loss), *operands)) == 2


@pytest.mark.parametrize("tree", [False, True], ids=["segments", "prefix"])
def test_segment_attention_kernel_compiles(mesh, tree):
    """Splash attention ("auto" on a TPU), forward and gradient, for rows of 512 tokens
    (blocks of 512; the 128-token block only keeps the dense path for short rows off),
    Qwen2.5's grouped heads (14 query, 2 kv, head_dim 64); with prefix ids the tree
    layout's two passes."""
    seg, pre = tree_batch(512)
    rows = 4 * (-(-seg.shape[0] // 4))
    seg, pre = np.resize(seg, (rows, 512)), np.resize(pre, (rows, 512))
    x = NamedSharding(mesh, P("data", None, None, None))

    def loss(q, k, v):
        out = segment_attention(q, k, v, jnp.asarray(seg), prefix_ids=jnp.asarray(pre)
                                if tree else None, impl="splash", block=128)
        return jnp.sum(out.astype(jnp.float32))

    grad = _compiled(mesh, jax.grad(loss, argnums=(0, 1, 2)),
                     ((rows, 512, 14, 64), jnp.bfloat16, x),
                     *[((rows, 512, 2, 64), jnp.bfloat16, x)] * 2)
    # Forward, dq and dk/dv per pass; the tree layout runs two passes.
    assert _kernels(grad) == (6 if tree else 3)
