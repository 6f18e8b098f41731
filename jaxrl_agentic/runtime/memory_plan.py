"""What a run will hold in memory, per device, before it allocates any of it.

:func:`memory_plan` estimates, from the model's config and the run's settings alone:

    parameters      P · b_param / (fsdp · tensor)         (P parameters, b = bytes per value)
                    + Q · b_param with LoRA (Q adapter values, replicated)
    reference       P · min(b_param, b_compute) / (fsdp · tensor) when a KL reference is kept
                    (init_kl_coef or target_kl; its matrices are stored in the compute dtype;
                    none with LoRA, whose reference is the frozen base)
    teacher         P_T · min(4, b_T) / (fsdp · tensor) with on-policy distillation (its
                    matrices in its compute dtype b_T; its forward runs without a backward
                    and before the update, so its activations are not counted beside these)
    critic          3 · P' · b_param with GAE: the value model's own copy of the backbone and
                    its two AdamW moments (its gradients and activations live in its own
                    update step, which runs apart from the policy's)
    gradients       P' · 4                                (one group of rows' fp32 gradient)
    accumulator     P' · 4 when a mini-batch may span several groups of rows
                    (``accumulates``): the fp32 sum beside the group's own gradient
    optimizer       2 · P' · b_param                      (AdamW's first and second moments)
                    with P' = P / (fsdp · tensor), or Q with LoRA (only the adapters train)
    update          2 · P' · 4 on a TPU: XLA:TPU holds the AdamW update's fp32 updates and
                    new moments beside the donated state (for Qwen2.5-0.5B on v5e, v5p and
                    v6e chips at fsdp 1, 4 and 8 the compiler's temporaries exceed the other
                    items by 2·P'·4 plus 0.6–1.2 GiB that no sharding divides); XLA:CPU and
                    GPU write them over the state (``tests/training/test_update_memory.py``)
    activations     one group of rows of the train step's scan, one row per device:
                      remat "none"   L · a_layer(T)
                      remat "layer"  2L · T · D · b + a_layer(T)
                      remat "dots"   L · T · (2D + 2K·h + 3F) · b + a_layer(T)
                      a_layer(T) = T·(15D + 7F)·b + H·s(T)·(9 + b) + 4·H·T
                      s(T) = T² with dense attention (``attention_impl="reference"``, or
                             T ≤ 256), else 0: segment attention keeps only its inputs,
                             output and the log-sum-exp (4·H·T), never scores
                    (with remat the blocks run as a scan over their weights, which are
                    stored stacked: no copy of them or of their gradient)
    lm head         S · min(V, 8192) · 4 · 3 (fp32 logits of a vocabulary chunk at the S loss
                    slots, their softmax and gradient; the full vocabulary with
                    ``kernel_impl="reference"``)
    sampler params  (P + P_lora) · b_param on every device when the run spans several
                    hosts: each host's sampler reads a replica of the whole policy,
                    all-gathered from the learner's shards once per version
    kv cache        L · 2 · R · K · h · N · b_cache (R sampler rows, N their cache length)
    sampler logits  R · V · 4

(L layers, D hidden, F intermediate, H / K query / kv heads of size h, V vocabulary, T the
row length, S the loss slots per row.) The activation terms are the residuals counted by
JAX's ``saved_residuals`` for the learner's loss at small shapes (per score: fp32 logits,
probabilities and their mask, ≈ 13 bytes; per token: ~15 hidden-sized and ~7 MLP-sized
values), rounded up; the plan is an estimate that errs high. :func:`check_memory_plan`
turns it into a one-line error when the sharded training state alone cannot fit (certain
failure) and a warning naming what to change when the whole plan exceeds the budget.
"""

from __future__ import annotations

import dataclasses
import os

from jaxrl_agentic.models.config import ModelConfig
from pallas_kernels.segment_attention import runs_dense

GIB = 1024**3
_BYTES = {"float32": 4, "bfloat16": 2, "float16": 2}
_VOCAB_CHUNK = 8192  # the chunked / fused kernels hold at most this many logits per token


@dataclasses.dataclass(frozen=True)
class MemoryPlan:
    """Bytes per device, by item (``items`` in the order of the module doc)."""

    items: tuple[tuple[str, float], ...]
    budget: float  # bytes one device has (0 = unknown)

    @property
    def training_state(self) -> float:
        names = ("parameters", "sampler params", "reference", "teacher", "critic",
                 "gradients", "optimizer")
        return sum(b for n, b in self.items if n in names)

    @property
    def total(self) -> float:
        return sum(b for _, b in self.items)

    def table(self) -> str:
        lines = ["memory plan (per device, estimated):"]
        lines += [f"  {name:<15} {b / GIB:8.2f} GiB" for name, b in self.items]
        lines.append(f"  {'total':<15} {self.total / GIB:8.2f} GiB"
                     + (f" of {self.budget / GIB:.1f} GiB" if self.budget else ""))
        return "\n".join(lines)


def layer_activation_bytes(cfg: ModelConfig, row_len: int, attention_impl: str = "auto"
                           ) -> float:
    """``a_layer(T)``: what one block keeps for its backward at ``row_len`` tokens."""
    b, t = _BYTES[cfg.dtype], row_len
    scores = t * t if runs_dense(attention_impl, t) else 0
    return (t * (15 * cfg.hidden_size + 7 * cfg.intermediate_size) * b
            + cfg.num_attention_heads * (scores * (9 + b) + 4 * t))


def activation_bytes(cfg: ModelConfig, row_len: int, remat: str, attention_impl: str = "auto"
                     ) -> float:
    """Activations the train step keeps for one row (module doc)."""
    b, t, layers = _BYTES[cfg.dtype], row_len, cfg.num_hidden_layers
    one = layer_activation_bytes(cfg, t, attention_impl)
    if remat == "none":
        return layers * one
    if remat == "layer":
        return 2 * layers * t * cfg.hidden_size * b + one
    kv = cfg.num_key_value_heads * cfg.head_dim
    return layers * t * (2 * cfg.hidden_size + 2 * kv + 3 * cfg.intermediate_size) * b + one


def device_budget() -> float:
    """Bytes one device may use: the accelerator's limit, or the host's RAM on CPU."""
    import jax

    device = jax.local_devices()[0]  # another process's device cannot be asked
    stats = device.memory_stats() if hasattr(device, "memory_stats") else None
    if stats and stats.get("bytes_limit"):
        return float(stats["bytes_limit"])
    try:
        return float(os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES"))
    except (ValueError, OSError, AttributeError):
        return 0.0


def memory_plan(cfg: ModelConfig, *, row_len: int, loss_slots: int, remat: str,
                kernel_impl: str, reference: bool, shards: int = 1, sampler_rows: int = 0,
                sampler_len: int = 0, budget: float = 0.0, host_devices: int = 1,
                attention_impl: str = "auto", accumulates: bool = True,
                lora_params: int = 0, teacher: ModelConfig | None = None,
                context: int = 1, platform: str = "cpu", critic: bool = False,
                cache_shards: int | None = None, logits_shards: int | None = None,
                sampler_replica: bool = False) -> MemoryPlan:
    """The plan (module doc). ``shards`` = fsdp · tensor; ``context``: the mesh's context
    axis, over which each row's tokens are split (a device's activations and loss slots
    are those of ``row_len / context`` tokens, plus one layer's keys and values of the whole
    row, all-gathered, and their gradients: ``pallas_kernels/context_attention.py``);
    ``host_devices``: devices sharing one host's RAM when the budget is the host's (CPU),
    whose states all count; ``platform``: the backend the programs compile for ("tpu"
    counts the optimizer update's temporaries);
    ``accumulates``: whether a mini-batch may need more than one group of rows;
    ``lora_params``: the adapters' values when LoRA trains them alone (0 = full training);
    ``teacher``: on-policy distillation's teacher, its ``dtype`` the one it computes in;
    ``critic``: GAE's value model (module doc); ``cache_shards`` / ``logits_shards``: the
    devices the sampler's kv cache (rows and kv heads) and its logits (rows) are split over,
    so that a device holds that share of the ``sampler_rows`` (default: ``host_devices``);
    ``sampler_replica``: every device also holds the whole policy for its host's sampler
    (a run over several hosts: ``runtime.parallel.SamplerPlacement``)."""
    p = cfg.num_params()
    pb = _BYTES[cfg.param_dtype]
    per = p / shards
    trained = lora_params if lora_params else per
    reference = reference and not lora_params
    vocab = cfg.vocab_size if kernel_impl == "reference" else min(cfg.vocab_size, _VOCAB_CHUNK)
    tokens = -(-row_len // max(context, 1))
    activations = activation_bytes(cfg, tokens, remat, attention_impl)
    if context > 1:
        activations += 2 * row_len * 2 * cfg.num_key_value_heads * cfg.head_dim \
            * _BYTES[cfg.dtype]
    cache = (cfg.num_hidden_layers * 2 * sampler_rows * cfg.num_key_value_heads * cfg.head_dim
             * sampler_len * _BYTES[cfg.dtype])
    items = (
        ("parameters", (per + lora_params) * pb),
        ("sampler params", (p + lora_params) * pb if sampler_replica else 0.0),
        ("reference", per * min(pb, _BYTES[cfg.dtype]) if reference else 0.0),
        ("teacher", teacher.num_params() / shards * min(4, _BYTES[teacher.dtype])
         if teacher is not None else 0.0),
        ("critic", 3 * per * pb if critic else 0.0),
        ("gradients", trained * 4),
        ("accumulator", trained * 4 if accumulates else 0.0),
        ("optimizer", 2 * trained * pb),
        ("update", 2 * trained * 4 if platform == "tpu" else 0.0),
        ("activations", activations),
        ("lm head", min(loss_slots, tokens) * vocab * 4 * 3),
        ("kv cache", cache / max(cache_shards or host_devices, 1)),
        ("sampler logits", sampler_rows * cfg.vocab_size * 4
         / max(logits_shards or host_devices, 1)),
    )
    if host_devices > 1:  # one RAM holds every device's share
        items = tuple((n, b * host_devices) for n, b in items)
    return MemoryPlan(items=items, budget=budget)


def check_memory_plan(plan: MemoryPlan, warn=print) -> None:
    """Raises ``ValueError`` (one line) if the training state alone exceeds the budget;
    warns, naming the settings that shrink the plan, if the whole plan does."""
    if not plan.budget:
        return
    gib = lambda b: f"{b / GIB:.1f} GiB"  # noqa: E731
    if plan.training_state > plan.budget:
        raise ValueError(
            f"the parameters, gradients and optimizer state need {gib(plan.training_state)} "
            f"per device, over its {gib(plan.budget)}: shard them over more devices "
            f"(mesh.fsdp), use param_dtype='bfloat16', or drop the KL reference "
            f"(init_kl_coef=0)")
    if plan.total > plan.budget:
        big = dict(plan.items)
        advice = []
        if big["activations"] > 0.2 * plan.total:
            advice.append("remat='layer' or a smaller micro_batch_max_tokens")
        if big["kv cache"] + big["sampler logits"] > 0.2 * plan.total:
            advice.append("fewer episodes per step (train_env_manager) or a shorter "
                          "max_input_length")
        if big["lm head"] > 0.2 * plan.total:
            advice.append("kernel_impl='auto' and a smaller micro_batch_max_loss_tokens")
        warn(f"warning: the memory plan ({gib(plan.total)} per device) exceeds the "
             f"{gib(plan.budget)} available; "
             + ("; ".join(advice) or "see the plan above") + ".")


# glibc's malloc raises its mmap threshold after every large free (up to 32 MiB), so the
# blocks of a few MiB a real model frees by the thousand (a 0.5B layer's 17 MiB matrices,
# their gradients, activations) land in its heaps, whose freed pages stay resident. With
# fixed thresholds they are mapped and unmapped on their own, which lowers a real model's
# peak RSS (docs/benchmarks.md, "Peak memory"). Mapping each block costs page faults, so the
# pipeline sets it only for runs whose plan takes more than this share of the device.
MALLOC_RELEASE_SHARE = 0.25
_MMAP_THRESHOLD = 1 << 20
_TRIM_THRESHOLD = 8 << 20


def return_freed_memory_to_os() -> bool:
    """Makes glibc's malloc give freed blocks of ≥ 1 MiB back to the OS (fixed mmap and
    trim thresholds instead of its adaptive ones). Process-wide; False where the C
    library has no ``mallopt`` (not glibc) or refuses."""
    import ctypes
    import ctypes.util

    try:
        libc = ctypes.CDLL(ctypes.util.find_library("c") or None)
        mallopt = libc.mallopt
    except (OSError, AttributeError):
        return False
    m_trim_threshold, m_mmap_threshold = -1, -3  # <malloc.h>
    return bool(mallopt(m_mmap_threshold, _MMAP_THRESHOLD)
                and mallopt(m_trim_threshold, _TRIM_THRESHOLD))


def peak_rss_bytes() -> float:
    """This process's peak resident set size (Linux ``ru_maxrss`` is in KiB)."""
    import resource

    return float(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss) * 1024.0


__all__ = ["MemoryPlan", "activation_bytes", "check_memory_plan", "device_budget",
           "layer_activation_bytes", "memory_plan", "peak_rss_bytes",
           "return_freed_memory_to_os", "GIB", "MALLOC_RELEASE_SHARE"]
