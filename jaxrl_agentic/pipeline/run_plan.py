"""A run's memory plan and sampler cache length, from its config and its model's shapes.

``Pipeline`` prints this plan before any weight is read, and ``compile_tpu`` sets it beside
the compiler's figures for a topology this machine lacks (``pipeline/aot_programs.py``):
one function, so the two can never plan different runs.
"""

from __future__ import annotations

import math

import numpy as np
from jax.sharding import AbstractMesh

from jaxrl_agentic.models import lora
from jaxrl_agentic.models.config import ModelConfig
from jaxrl_agentic.runtime import memory_plan as plans
from jaxrl_agentic.runtime.parallel import kv_cache_sharding, num_batch_shards, rows_sharding


def max_total_len(cfg) -> int:
    """The sampler's cache length: the longest prompt, one turn's new tokens and the EOS
    the code may append, rounded up to 64."""
    return -(-(cfg.rollout.max_input_length + cfg.max_tokens_per_step + 1) // 64) * 64


def run_memory_plan(cfg, model: ModelConfig, mesh, budget: float, *, host_devices: int = 1,
                    teacher: ModelConfig | None = None, platform: str | None = None
                    ) -> plans.MemoryPlan:
    """``runtime.memory_plan.memory_plan`` for run config ``cfg`` on ``mesh``, per device.

    ``host_devices``: devices that share one host's memory (CPU devices); ``teacher``: the
    distillation teacher's config, when it is held beside the policy; ``platform``: what
    the programs compile for (default: the mesh's devices')."""
    learner, packing = cfg.learner, cfg.learner.packing
    rows = cfg.train.manager.num_episodes
    return plans.memory_plan(
        model, row_len=packing.micro_batch_max_tokens, loss_slots=packing.loss_slots_per_row,
        remat=learner.remat, kernel_impl=learner.kernel_impl,
        reference=learner.uses_reference, attention_impl=learner.attention_impl,
        shards=mesh.shape["fsdp"] * mesh.shape["tensor"], context=mesh.shape.get("context", 1),
        platform=platform or mesh.devices.flat[0].platform,
        sampler_rows=rows, sampler_len=max_total_len(cfg),
        # the sampler's own placements: rows over data × fsdp, kv heads over tensor
        cache_shards=_split(kv_cache_sharding(mesh, (rows, model.num_key_value_heads, 1, 1)),
                            (rows, model.num_key_value_heads, 1, 1)),
        logits_shards=_split(rows_sharding(mesh, rows), (rows, 1)),
        sampler_replica=mesh_hosts(mesh) > 1,
        budget=budget, host_devices=host_devices,
        lora_params=lora.adapter_count(model, cfg.model.lora), teacher=teacher,
        critic=cfg.critic is not None,
        # A mini-batch fits one scan step (one row per batch shard) when its longest
        # possible samples do; otherwise the update accumulates over groups of rows.
        accumulates=(learner.mini_batch_size
                     * min(packing.sequence_length, packing.micro_batch_max_tokens)
                     > packing.micro_batch_max_tokens * num_batch_shards(mesh)))


def _split(sharding, shape: tuple[int, ...]) -> int:
    """How many ways `sharding` splits an array of `shape` (1: replicated)."""
    return math.prod(shape) // math.prod(sharding.shard_shape(shape))


def mesh_hosts(mesh) -> int:
    """How many hosts (processes) ``mesh``'s devices belong to; 1 for an abstract mesh."""
    if isinstance(mesh, AbstractMesh):
        return 1
    return len({d.process_index for d in np.asarray(mesh.devices).flat})
