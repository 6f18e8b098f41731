"""What one update holds in memory, counted by XLA's own ``memory_analysis`` of the compiled
train step, and the allocator setting that lets freed blocks leave the process.

A model whose parameters dominate (embedding 8,192 × 256 of its 4.2 M parameters, rows of
64 tokens) makes the step's temporaries a multiple of the parameter bytes P:

* the state (parameters, AdamW's moments) is donated and updated in place: the outputs
  alias 3 P;
* a mini-batch of one row group needs its gradient (P) and a part of the tied embedding's
  gradient beside it: 1.31–1.54 P. Earlier versions held 2.82 P (the non-finite guard
  chose between a new and the old state with ``jnp.where``, both alive, and a one-group
  batch still added its gradient to an fp32 accumulator) and then 2.0–2.15 P (the gradient
  divided by the loss denominator and optax's clip, a divide per element, were each kept
  as a second gradient-sized buffer, and the tied embedding's two gradients were
  differentiated apart; ``update.clip_gradients``,
  ``models.transformer.tied_input_and_head``).
"""

import dataclasses
import functools
import os
import subprocess
import sys

import jax
import jax.numpy as jnp
import pytest
from flax import nnx

from jaxrl_agentic.models.config import ModelConfig
from jaxrl_agentic.models.transformer import Transformer
from jaxrl_agentic.runtime.parallel import make_mesh, train_state_shardings
from jaxrl_agentic.training.learner import TRAIN_BATCH_KEYS, init_train_state, make_train_step
from jaxrl_agentic.training.learner_config import LearnerConfig

CFG = ModelConfig(vocab_size=8192, hidden_size=256, intermediate_size=1024,
                  num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                  head_dim=64, param_dtype="float32")


@functools.cache  # one compile per shape for the whole module
def step_memory(dtype: str, remat: str, rows: int):
    """(memory_analysis, parameter bytes) of the train step on ``rows`` rows of 64 tokens,
    compiled from abstract shapes (nothing is allocated)."""
    cfg = dataclasses.replace(CFG, dtype=dtype)
    config = LearnerConfig(remat=remat)
    graphdef, params = nnx.split(nnx.eval_shape(lambda: Transformer(cfg, rngs=nnx.Rngs(0))))
    state = jax.eval_shape(lambda p: init_train_state(p, config), params)
    mesh = make_mesh()
    step = make_train_step(graphdef, config, mesh, train_state_shardings(state, mesh))
    ints = ("tokens", "positions", "segment_ids")
    batch = {k: jax.ShapeDtypeStruct((rows, 64), jnp.int32 if k in ints else jnp.float32)
             for k in TRAIN_BATCH_KEYS}
    batch["loss_index"] = jax.ShapeDtypeStruct((rows, 16), jnp.int32)
    compiled = step.lower(state, batch, jax.ShapeDtypeStruct((), jnp.float32)).compile()
    param_bytes = sum(x.size * x.dtype.itemsize for x in jax.tree.leaves(params))
    return compiled.memory_analysis(), param_bytes


@pytest.mark.parametrize("dtype,remat", [("float32", "none"), ("bfloat16", "layer")])
def test_one_group_update_holds_one_gradient_and_updates_the_state_in_place(dtype, remat):
    analysis, p = step_memory(dtype, remat, rows=1)
    # Parameters and both moments are written over the donated buffers.
    assert analysis.alias_size_in_bytes >= 3 * p
    assert analysis.temp_size_in_bytes <= 1.7 * p, analysis.temp_size_in_bytes / p


def test_two_groups_add_one_accumulator():
    """Several row groups need the fp32 accumulator beside one group's gradient: about one
    P more than a single group, never the 2 P a second state would cost."""
    one, p = step_memory("float32", "none", rows=1)
    two, _ = step_memory("float32", "none", rows=2)
    assert two.temp_size_in_bytes <= one.temp_size_in_bytes + 1.2 * p


_FRAGMENTED_RSS = """
import ctypes, sys
from jaxrl_agentic.runtime.memory_plan import return_freed_memory_to_os
if sys.argv[1] == "fixed":
    assert return_freed_memory_to_os()
libc = ctypes.CDLL(None)
libc.malloc.restype = ctypes.c_void_p
libc.malloc.argtypes = [ctypes.c_size_t]
libc.free.argtypes = [ctypes.c_void_p]
n = 8 << 20
first = libc.malloc(n); ctypes.memset(first, 1, n); libc.free(first)  # glibc adapts here
blocks = []
for _ in range(48):
    blocks.append(libc.malloc(n)); ctypes.memset(blocks[-1], 1, n)
for b in blocks[:-1]:  # the last one stays: it pins the top of the heap, as live data does
    libc.free(b)
rss = [int(line.split()[1]) for line in open("/proc/self/status") if line.startswith("VmRSS")]
print(rss[0] * 1024)
"""


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="glibc's malloc, /proc")
def test_freed_blocks_of_a_few_mib_leave_the_process():
    """47 freed 8 MiB blocks stay resident under glibc's adaptive thresholds (the first
    free raises its mmap threshold, so the rest come from the heap) and are returned with
    the fixed ones `Pipeline` sets."""
    def resident(mode):
        out = subprocess.run([sys.executable, "-c", _FRAGMENTED_RSS, mode], check=True,
                             capture_output=True, text=True, env=dict(os.environ))
        return int(out.stdout.split()[-1])

    freed = 47 * (8 << 20)
    assert resident("adaptive") - resident("fixed") >= 0.8 * freed
