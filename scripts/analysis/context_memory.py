"""Temp bytes per device of the learner's loss-and-gradient program on meshes with a
``context`` axis of 1, 2 and 4 devices (XLA's ``memory_analysis`` of the compiled program,
not RSS): what context parallelism saves in activation memory at a row length.

    taskset -c 0 python scripts/analysis/context_memory.py --row-len 8192

Runs on CPU with 4 forced host devices (set before jax is imported); compiles only. The
model is the tiny test shape of ``tests/runtime/test_context_parallel.py`` unless
``--hidden`` / ``--layers`` say otherwise; rows are packed with tree packing (groups of
continuations sharing a prompt) to the row length.
"""

from __future__ import annotations

import argparse
import os

os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "")
                           + " --xla_force_host_platform_device_count=4")
os.environ.setdefault("JAX_PLATFORMS", "cpu")

import jax  # noqa: E402
import numpy as np  # noqa: E402
from flax import nnx  # noqa: E402

from jaxrl_agentic.data import PackingConfig, Sample  # noqa: E402
from jaxrl_agentic.data.packing import pack_tree  # noqa: E402
from jaxrl_agentic.models.config import ModelConfig  # noqa: E402
from jaxrl_agentic.models.transformer import Transformer  # noqa: E402
from jaxrl_agentic.runtime.parallel import (  # noqa: E402
    batch_sharding,
    make_mesh,
    train_state_shardings,
)
from jaxrl_agentic.training.learner import make_loss_and_grads  # noqa: E402
from jaxrl_agentic.training.learner_config import LearnerConfig  # noqa: E402
from jaxrl_agentic.training.update import kernels_see_mesh  # noqa: E402


def packed_batch(row_len: int, rows: int, seed: int = 0) -> dict:
    """``rows`` tree-packed rows of ``row_len`` tokens: groups of 3 continuations of a
    shared prompt, each about row_len / 16 tokens."""
    rng = np.random.default_rng(seed)
    samples, unit = [], max(row_len // 16, 8)
    for g in range(3 * rows):
        head = rng.integers(1, 64, unit)
        for m in range(3):
            tokens = np.concatenate([head, rng.integers(1, 64, unit + 5 * m)])
            mask = np.r_[np.zeros(unit), np.ones(len(tokens) - unit)]
            samples.append(Sample(tokens=tokens, loss_mask=mask, old_logprobs=-4.0 * mask,
                                  advantages=mask * rng.normal(), traj_id=10 * g + m,
                                  prompt_len=unit))
    packed = pack_tree(samples, micro_batch_max_tokens=row_len, sequence_length=row_len,
                       num_rows=rows)
    keys = ("tokens", "positions", "segment_ids", "loss_mask", "advantages", "old_logprobs",
            "loss_index", "prefix_ids")
    return {k: packed.device_arrays()[k] for k in keys}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--row-len", type=int, default=512)
    parser.add_argument("--rows", type=int, default=1)
    parser.add_argument("--hidden", type=int, default=32)
    parser.add_argument("--layers", type=int, default=2)
    args = parser.parse_args()
    cfg = ModelConfig(vocab_size=64, hidden_size=args.hidden, intermediate_size=2 * args.hidden,
                      num_hidden_layers=args.layers, num_attention_heads=4,
                      num_key_value_heads=2, head_dim=args.hidden // 4)
    graphdef, params = nnx.split(Transformer(cfg, rngs=nnx.Rngs(0)))
    config = LearnerConfig(packing=PackingConfig(
        micro_batch_max_tokens=args.row_len, sequence_length=args.row_len,
        share_group_prefix=True, row_prefixes=0))
    batch = packed_batch(args.row_len, args.rows)
    for context in (1, 2, 4):
        mesh = make_mesh(1, 1, 1, devices=jax.devices()[:context], context=context)
        shardings = train_state_shardings(params, mesh)
        fn = kernels_see_mesh(mesh)(make_loss_and_grads(graphdef, config, mesh))
        compiled = jax.jit(fn, in_shardings=(shardings, batch_sharding(mesh), None)).lower(
            params, batch, 0.0).compile()
        temp = compiled.memory_analysis().temp_size_in_bytes
        print(f"row_len={args.row_len} rows={args.rows} context={context}: "
              f"temp {temp / 2**20:.2f} MiB per device")


if __name__ == "__main__":
    main()
