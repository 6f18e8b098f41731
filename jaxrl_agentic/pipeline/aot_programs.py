"""A run's compiled programs, built from shapes alone, for a topology this machine lacks.

:func:`run_programs` builds what a run compiles — the learner's update step for each row
shape its packing can produce (with a dense distillation loss, the teacher's forward in
it), the per-token logprob programs (old policy, the reference when it is stored apart, a
distillation teacher's), the sampler's prefill and decode at the largest shapes
a rollout gives them — on a mesh of the topology's devices made with the run's own
``config.mesh`` and partition rules (``runtime/parallel.py``). No weight is read: the
model's config comes from the recipe's ``pretrain`` (its config.json, or
``models/known_shapes.py`` for a published checkpoint that is not here), and parameters,
train state and batches are ``ShapeDtypeStruct``s with the shardings the run would give
them. ``compile_tpu`` compiles each (``runtime/aot.py``) and sets the compiler's figures
beside ``run_plan.run_memory_plan``, the plan ``Pipeline`` prints.

Shapes, as the run makes them:

- update step: ``[rows, T]`` token arrays and ``[rows, S]`` loss slots, rows = the
  mini-batch rounded up to the batch shards (``fixed_rows``; else the most rows
  ``bucket_rows`` gives a mini-batch), T each of ``packing.row_lengths()``, S =
  ``packing.loss_slots_for(T)`` (its largest: smaller loss-slot buckets only shrink it);
- logprobs: rows for one step's samples (episodes, × turns with step-wise samples), next
  power of two, rounded up to the shards (``per_token.per_sample_outputs``);
- critic (GAE): its update step at each row length of the update step's shape, and its
  values program at the logprob programs' shape (``training/critic.py``: the value model,
  its own train state);
- sampler (turn batching): a session of the next power of two of one tag's episodes,
  prefill of ``next_power_of_two(max_input_length)`` tokens into a cache of the run's
  ``max_total_len``, decode of ``next_power_of_two(max_tokens_per_step)`` new tokens;
  continuous batching (and in-flight updates) adds the slot decoder's chunk program
  (``sampling/slot_decoder.py``): every slot of a pool of ``rollout.slots`` (0: one per
  episode, the next power of two) over a fixed cache of ``max_total_len``, on a mesh
  always the whole pool's rows, ``decode_chunk_tokens`` steps a call;
- over several hosts (a topology of more than one host's chips): the weight hand-over
  (``handover_program``: the policy all-gathered from the learner's shards, every chip's
  output the whole policy), and the sampler's programs on one host's chips, reading that
  replica, at its share of the episodes.
"""

from __future__ import annotations

import dataclasses
import functools
from typing import Any

import jax
import jax.numpy as jnp
from flax import nnx

from jaxrl_agentic.data import bucket_rows, round_up_to_bucket
from jaxrl_agentic.models import lora
from jaxrl_agentic.models.config import ModelConfig
from jaxrl_agentic.models.known_shapes import known_model_config
from jaxrl_agentic.models.transformer import KVCache, Transformer, in_compute_dtype
from jaxrl_agentic.pipeline.run_plan import max_total_len, mesh_hosts
from jaxrl_agentic.runtime.aot import abstract, global_bytes, shard_bytes
from jaxrl_agentic.runtime.parallel import (
    kv_cache_sharding,
    make_mesh,
    num_batch_shards,
    replicated,
    rows_sharding,
    stacked_layer_dims,
    train_state_shardings,
)
from jaxrl_agentic.sampling.buckets import next_power_of_two
from jaxrl_agentic.sampling.draws import stop_ids_array
from jaxrl_agentic.sampling.jax_sampler import Sampler
from jaxrl_agentic.training.learner import (
    LOGPROB_BATCH_KEYS,
    TRAIN_BATCH_KEYS,
    full_params,
    init_train_state,
    make_compute_logprobs,
    policy_update_loss,
)
from jaxrl_agentic.training.teacher import mark_other_argmax
from jaxrl_agentic.training.update import make_update_step

PROGRAM_NAMES = ("update_step", "logprobs", "ref_logprobs", "teacher_logprobs",
                 "critic_update", "critic_values", "weight_handover", "sampler_prefill",
                 "sampler_decode", "sampler_decode_chunk")
_INT_KEYS = ("tokens", "positions", "segment_ids", "loss_index", "prefix_ids")


@dataclasses.dataclass(frozen=True)
class Program:
    """One jitted program and the abstract arguments it is compiled for; ``resident``: the
    bytes per chip of its arguments that live on between programs (the train state)."""

    name: str
    fn: Any
    args: tuple
    shape: dict
    resident: float


@dataclasses.dataclass(frozen=True)
class RunPrograms:
    """The programs of a run, and the per-chip bytes of what stays resident."""

    programs: list[Program]
    mesh: Any
    model: ModelConfig
    state_bytes: float  # the train state (+ LoRA's frozen base, a teacher) per chip
    param_bytes: float  # the policy's parameters per chip
    param_global_bytes: float
    notes: tuple[str, ...]
    replica_bytes: float = 0.0  # over several hosts: the sampler's policy replica, in the state


def model_config(cfg) -> tuple[ModelConfig, str]:
    """(the run's model config, where it came from): the checkpoint's config.json when
    ``pretrain`` resolves to a directory here, else ``models/known_shapes.py``'s table."""
    from jaxrl_agentic.models.hf_io import read_model_config

    m = cfg.model
    try:
        directory = m.directory()
        return (read_model_config(directory, m.dtype, m.param_dtype, m.untie_word_embeddings),
                f"{directory}/config.json")
    except (ValueError, OSError) as e:  # hf_io.CheckpointError is a ValueError
        known = known_model_config(m.pretrain, m.dtype, m.param_dtype, m.untie_word_embeddings)
        if known is None:
            raise ValueError(f"config.pretrain: {e} and {m.pretrain!r} names no shape in "
                             "models/known_shapes.py") from None
        return known, f"models/known_shapes.py ({m.pretrain} is not on this machine)"


def run_mesh(cfg, devices):
    """The learner's mesh over ``devices``, as ``Pipeline`` makes it from ``config.mesh``."""
    if cfg.mesh.sampler_devices:
        raise ValueError("config.mesh.sampler_devices: compile_tpu compiles the colocated "
                         "layout only (sampler_devices=0)")
    try:
        return make_mesh(data=cfg.mesh.data, fsdp=cfg.mesh.fsdp, tensor=cfg.mesh.tensor,
                         context=cfg.mesh.context, devices=list(devices))
    except ValueError as e:
        raise ValueError(f"config.mesh: {e}") from None


def _abstract_model(model: ModelConfig, lora_config, seed: int):
    def build():
        m = Transformer(model, rngs=nnx.Rngs(seed))
        return lora.add_lora(m, lora_config, seed=seed) if lora_config.enabled else m

    return nnx.eval_shape(build)


def _abstract_teacher(cfg, mesh):
    """``(graphdef, abstract params, shardings)`` of the distillation teacher as
    ``training.teacher.Teacher`` holds it (matrices in its compute dtype, the parameter
    partition rules), from its config.json alone; None without a teacher."""
    from jaxrl_agentic.pipeline.distillation import teacher_model_config

    model = teacher_model_config(cfg.distillation)
    if model is None:
        return None
    graphdef, params = nnx.split(nnx.eval_shape(lambda: Transformer(model, rngs=nnx.Rngs(0))))
    stored = jax.eval_shape(lambda p: jax.tree_util.tree_map_with_path(
        lambda path, x: in_compute_dtype(x, model.dtype, stacked_layer_dims(path)), p), params)
    shardings = train_state_shardings(stored, mesh)
    return graphdef, abstract(stored, shardings), shardings


def _batch(keys, rows: int, row_len: int, loss_slots: int, mesh) -> dict:
    sharding = jax.sharding.NamedSharding(mesh, jax.sharding.PartitionSpec(
        ("data", "fsdp"), None))

    def one(key):
        width = loss_slots if key == "loss_index" else row_len
        dtype = jnp.int32 if key in _INT_KEYS else jnp.float32
        return jax.ShapeDtypeStruct((rows, width), dtype, sharding=sharding)

    return {k: one(k) for k in keys}


def _update_rows(cfg, mesh) -> int:
    learner = cfg.learner
    shards = num_batch_shards(mesh)
    if learner.packing.fixed_rows:
        return round_up_to_bucket(learner.mini_batch_size, shards)
    return round_up_to_bucket(bucket_rows(learner.mini_batch_size, learner.packing.rows_bucket),
                              shards)


def _logprob_rows(cfg, mesh) -> int:
    per_episode = cfg.max_turns if cfg.advantages.sample_mode != "trajectory" else 1
    samples = cfg.train.manager.num_episodes * per_episode
    return round_up_to_bucket(bucket_rows(samples, 0), num_batch_shards(mesh))


def learner_programs(cfg, model: ModelConfig, mesh, row_lens: str = "all"):
    """(programs, state per chip, params per chip, params in all, graphdef, abstract params
    with shardings): update step and logprob programs (module doc)."""
    learner = cfg.learner
    model_abs = _abstract_model(model, cfg.model.lora, cfg.run.seed)
    if cfg.model.lora.enabled:
        graphdef, params, frozen = lora.split_trainable(model_abs)
    else:
        (graphdef, params), frozen = nnx.split(model_abs), None
    state = jax.eval_shape(lambda p, f: init_train_state(p, learner, ref_dtype=model.dtype,
                                                         frozen=f), params, frozen)
    shardings = train_state_shardings(state, mesh)
    state_abs = abstract(state, shardings)
    frozen_shardings = None if frozen is None else train_state_shardings(frozen, mesh)
    frozen_abs = None if frozen is None else abstract(frozen, frozen_shardings)
    full_abs = full_params(state_abs.params, frozen_abs)
    full_shardings = full_params(shardings.params, frozen_shardings)
    resident = shard_bytes(state_abs) + (0.0 if frozen_abs is None else shard_bytes(frozen_abs))
    lr = jax.ShapeDtypeStruct((), jnp.float32, sharding=replicated(mesh))
    teacher = _abstract_teacher(cfg, mesh)
    if teacher is not None:  # held on the learner's mesh for the whole run
        resident += shard_bytes(teacher[1])
    # A dense distillation loss reads the teacher in every update (its third argument).
    in_update = teacher if learner.uses_teacher else None

    update = make_update_step(
        policy_update_loss(graphdef, learner, None if in_update is None else in_update[0]),
        learner, mesh, shardings, None, frozen_shardings,
        None if in_update is None else in_update[2])
    train_keys = learner.packing.batch_keys(
        TRAIN_BATCH_KEYS + (("ref_logprobs",) if learner.uses_reference else ()))
    lengths = learner.packing.row_lengths()
    if row_lens == "longest":
        lengths = lengths[:1]
    programs, rows = [], _update_rows(cfg, mesh)
    for row_len in lengths:
        slots = learner.packing.loss_slots_for(row_len)
        batch = _batch(train_keys, rows, row_len, slots, mesh)
        args = (state_abs, batch, lr) + tuple(x for x in (
            frozen_abs, None if in_update is None else in_update[1]) if x is not None)
        programs.append(Program("update_step", update, args,
                                {"rows": rows, "row_len": row_len, "loss_slots": slots},
                                resident))

    logprob_keys = learner.packing.batch_keys(LOGPROB_BATCH_KEYS)
    compute = make_compute_logprobs(graphdef, learner, mesh, full_shardings, None)
    passes = [("logprobs", compute, full_abs)]
    if learner.uses_reference and frozen is None:  # its own (compute-dtype) copy
        # The reference's logprobs are always its full softmax's (Learner.sample_logprobs).
        ref_compute = make_compute_logprobs(graphdef, learner, mesh, shardings.ref_params,
                                            None, logprob_filter=(0, 1.0))
        passes.append(("ref_logprobs", ref_compute, state_abs.ref_params))
    if teacher is not None:  # Teacher.judge: its full softmax, with the argmax mark
        passes.append(("teacher_logprobs", make_compute_logprobs(
            teacher[0], learner, mesh, teacher[2], None, logprob_filter=(0, 1.0),
            mark=mark_other_argmax), teacher[1]))
    rows = _logprob_rows(cfg, mesh)
    row_len = lengths[0]
    slots = learner.packing.loss_slots_for(row_len)
    for name, fn, weights in passes:
        batch = _batch(logprob_keys, rows, row_len, slots, mesh)
        programs.append(Program(name, fn, (weights, batch),
                                {"rows": rows, "row_len": row_len, "loss_slots": slots},
                                shard_bytes(weights)))
    return (programs, resident, shard_bytes(full_abs), global_bytes(full_abs), model_abs,
            full_abs)


def critic_programs(cfg, model: ModelConfig, mesh, row_lens: str = "all"
                    ) -> tuple[list[Program], float]:
    """(the critic's update-step and values programs, its train state per chip); ([], 0)
    without a critic (module doc)."""
    from jaxrl_agentic.models.value import ValueModel
    from jaxrl_agentic.training.critic import (
        CRITIC_BATCH_KEYS,
        VALUE_BATCH_KEYS,
        init_critic_state,
        make_compute_values,
        make_critic_train_step,
    )

    config = cfg.critic
    if config is None:
        return [], 0.0
    graphdef, params = nnx.split(nnx.eval_shape(
        lambda: ValueModel(model, rngs=nnx.Rngs(config.seed))))
    state = jax.eval_shape(lambda p: init_critic_state(p, config), params)
    shardings = train_state_shardings(state, mesh)
    state_abs = abstract(state, shardings)
    resident = shard_bytes(state_abs)
    lr = jax.ShapeDtypeStruct((), jnp.float32, sharding=replicated(mesh))
    step = make_critic_train_step(graphdef, config, mesh, shardings)
    keys = config.packing.batch_keys(CRITIC_BATCH_KEYS)
    lengths = config.packing.row_lengths()[:1 if row_lens == "longest" else None]
    programs, rows = [], _update_rows(cfg, mesh)
    for row_len in lengths:
        slots = config.packing.loss_slots_for(row_len)
        programs.append(Program("critic_update", step,
                                (state_abs, _batch(keys, rows, row_len, slots, mesh), lr),
                                {"rows": rows, "row_len": row_len, "loss_slots": slots},
                                resident))
    values = make_compute_values(graphdef, mesh, shardings.params,
                                 config.packing.row_prefixes,
                                 config.packing.batch_keys(VALUE_BATCH_KEYS))
    rows, row_len = _logprob_rows(cfg, mesh), lengths[0]
    slots = config.packing.loss_slots_for(row_len)
    batch = _batch(config.packing.batch_keys(VALUE_BATCH_KEYS), rows, row_len, slots, mesh)
    programs.append(Program("critic_values", values, (state_abs.params, batch),
                            {"rows": rows, "row_len": row_len}, shard_bytes(state_abs.params)))
    return programs, resident


def sampler_programs(cfg, model: ModelConfig, mesh, model_abs, params_abs, hosts: int = 1
                     ) -> list[Program]:
    """The JAX sampler's prefill and decode at a turn-batched rollout's largest shapes
    (module doc), reading `params_abs` (the learner's parameters in place when colocated;
    over several hosts, each host's replica on a mesh of its chips, playing its share of
    the episodes)."""
    total = max_total_len(cfg)
    sampler = Sampler(model_abs, None, max_total_len=total, mesh=mesh,
                      eos_token_id=model.eos_token_id or 0,
                      logprob_under_filter=cfg.rollout.logprob_under_sampling_filter)
    episodes = -(-max(len(plan) for plan in _episodes_per_tag(cfg)) // hosts)
    rows = next_power_of_two(episodes)
    cache = jax.eval_shape(functools.partial(KVCache.zeros, model, rows, total,
                                             sampler.cache_dtype))
    cache = abstract(cache, jax.tree.map(lambda x: kv_cache_sharding(mesh, x.shape), cache))
    resident = shard_bytes(params_abs)

    def row_input(shape, dtype):
        return jax.ShapeDtypeStruct(shape, dtype, sharding=rows_sharding(mesh, rows))

    length = min(next_power_of_two(cfg.rollout.max_input_length, sampler.min_prefill_bucket),
                 total)
    tokens = row_input((rows, length), jnp.int32)
    prefill_args = (params_abs, cache, tokens, row_input((rows, length), jnp.int32),
                    row_input((rows, length), jnp.bool_), None)
    repl = replicated(mesh)
    scalar = lambda dtype: jax.ShapeDtypeStruct((), dtype, sharding=repl)  # noqa: E731
    logits = jax.ShapeDtypeStruct((rows, model.vocab_size), jnp.float32,
                                  sharding=rows_sharding(mesh, rows))
    stops = stop_ids_array(1.0, 1.0, None)
    new_bucket = next_power_of_two(cfg.max_tokens_per_step)
    decode_args = (params_abs, cache, logits, row_input((rows,), jnp.int32),
                   row_input((rows,), jnp.bool_), row_input((rows,), jnp.int32),
                   jax.ShapeDtypeStruct((2,), jnp.uint32, sharding=repl),
                   row_input((rows,), jnp.int32), scalar(jnp.float32), scalar(jnp.int32),
                   scalar(jnp.float32), scalar(jnp.bool_),
                   jax.ShapeDtypeStruct(stops.shape, jnp.int32, sharding=repl))
    programs = [
        Program("sampler_prefill", _Bound(sampler.prefill_program, {"key_len": total}),
                prefill_args, {"rows": rows, "tokens": length, "cache_len": total}, resident),
        Program("sampler_decode", _Bound(sampler.decode_program,
                                         {"max_new_bucket": new_bucket}),
                decode_args, {"rows": rows, "max_new": new_bucket, "cache_len": total},
                resident),
    ]
    if cfg.rollout.batching == "continuous":
        programs.append(_decode_chunk_program(cfg, model, mesh, sampler, params_abs,
                                              episodes, decode_args[-5:]))
    return programs


def _decode_chunk_program(cfg, model: ModelConfig, mesh, sampler, params_abs, episodes: int,
                          sampling: tuple) -> Program:
    """The slot decoder's chunk program over a pool of every slot (module doc); `sampling`:
    the decode program's temperature, top-k, top-p, greedy and stop-id arguments."""
    from jaxrl_agentic.rollout.loop import RolloutRunner
    from jaxrl_agentic.sampling.slot_decoder import _chunk_program

    slots = min(episodes, cfg.rollout.slots or episodes)
    cap, max_len = next_power_of_two(slots), sampler.cache_bucket(sampler.max_total_len)
    cache = jax.eval_shape(functools.partial(KVCache.zeros, model, cap, max_len,
                                             sampler.cache_dtype))
    cache = abstract(cache, jax.tree.map(lambda x: kv_cache_sharding(mesh, x.shape), cache))

    def row(dtype, *trailing):
        return jax.ShapeDtypeStruct((cap, *trailing), dtype, sharding=rows_sharding(mesh, cap))

    grid = RolloutRunner.chunk_grid
    extents = sampler.key_extents(max_len, grid)
    chunk = cfg.rollout.decode_chunk_tokens
    new_bucket = next_power_of_two(cfg.max_tokens_per_step)
    args = (params_abs, cache, row(jnp.float32, model.vocab_size), row(jnp.bool_),
            row(jnp.int32), row(jnp.int32), row(jnp.bool_), row(jnp.int32), row(jnp.int32),
            row(jnp.uint32, 2), row(jnp.int32), *sampling, None,
            jax.ShapeDtypeStruct((), jnp.int32, sharding=replicated(mesh)))
    return Program("sampler_decode_chunk",
                   _Bound(_chunk_program(sampler), {"chunk": chunk,
                                                    "max_new_bucket": new_bucket,
                                                    "extents": extents}),
                   args, {"rows": cap, "chunk": chunk, "max_new": new_bucket,
                          "cache_len": max_len}, shard_bytes(params_abs))


class _Bound:
    """A jitted function with its static keyword arguments fixed, traceable like it."""

    def __init__(self, fn, static: dict):
        self.fn, self.static = fn, static

    def trace(self, *args):
        return self.fn.trace(*args, **self.static)


def _episodes_per_tag(cfg) -> list[list[int]]:
    """One list per train tag, as long as that tag's episodes in one step."""
    from jaxrl_agentic.rollout.groups import plan_episodes

    return list(plan_episodes(cfg.train.manager, split="train", cursor=0).values())


def handover_program(mesh, full_abs) -> tuple[Program, Any, Any]:
    """(the weight hand-over, the mesh of the first host's chips, the replica its sampler
    reads) of a run over several hosts: every process samples its own episodes from a
    process-local replica of the policy, refreshed once per version
    (``SamplerPlacement.params_for_sampler``): the learner's shards all-gathered by this
    program, whose output every chip holds, then placed, replicated, on the host's chips.
    On one host the colocated sampler reads the learner's params in place: no program."""
    gather = jax.jit(lambda tree: tree, out_shardings=replicated(mesh))
    first = mesh.devices.flat[0].process_index
    host_mesh = make_mesh(devices=[d for d in mesh.devices.flat if d.process_index == first])
    replica = abstract(full_abs, jax.tree.map(lambda _: replicated(host_mesh), full_abs))
    program = Program("weight_handover", gather, (full_abs,),
                      {"hosts": mesh_hosts(mesh), "params_bytes": int(global_bytes(full_abs))},
                      shard_bytes(full_abs))
    return program, host_mesh, replica


def run_programs(cfg, devices, *, row_lens: str = "all", sampler: bool = True
                 ) -> RunPrograms:
    """Every program of the run (module doc) on a mesh of ``devices``."""
    model, source = model_config(cfg)
    mesh = run_mesh(cfg, devices)
    programs, resident, params, params_global, model_abs, full_abs = learner_programs(
        cfg, model, mesh, row_lens)
    critic, critic_state = critic_programs(cfg, model, mesh, row_lens)
    programs, resident = programs + critic, resident + critic_state
    notes = [f"model: {source}"]
    hosts, sampler_mesh, sampler_params = mesh_hosts(mesh), mesh, full_abs
    if hosts > 1:  # the replica stays beside the train state between versions
        handover, sampler_mesh, sampler_params = handover_program(mesh, full_abs)
        programs.append(handover)
        resident += shard_bytes(sampler_params)
        notes.append(f"sampler: {hosts} hosts, each samples from a replica of the whole "
                     f"policy on its chips ({shard_bytes(sampler_params) / 2**30:.2f} GiB a "
                     "chip, in the train state)")
    if sampler:
        if cfg.rollout.sampler_backend != "jax":
            notes.append(f"sampler: backend {cfg.rollout.sampler_backend!r} is not compiled")
        else:
            programs += sampler_programs(cfg, model, sampler_mesh, model_abs, sampler_params,
                                         hosts)
            if cfg.rollout.batching == "continuous":
                notes.append("sampler: continuous batching's prefill is the turn-batched "
                             "one at the pool's rows (its compact prefills are smaller)")
    return RunPrograms(programs, mesh, model, resident, params, params_global, tuple(notes),
                       shard_bytes(sampler_params) if hosts > 1 else 0.0)


__all__ = ["PROGRAM_NAMES", "Program", "RunPrograms", "critic_programs", "handover_program",
           "learner_programs", "model_config", "run_mesh", "run_programs", "sampler_programs"]
