"""The teacher of on-policy distillation: a frozen model that judges the student's tokens.

This module owns the model; the objective that uses it, the teacher's sources, its
tokenizer check and its loading are ``pipeline/distillation.py``'s. Its architecture may
differ from the student's (width, depth, heads): its logprob program is compiled for its
own graph.

**How it is held.** On the learner's mesh under the parameter partition rules
(``runtime.parallel.param_partition_spec``), frozen (no optimizer state, never donated),
its matrices stored in the teacher's compute dtype (``models.transformer.in_compute_dtype``,
as the learner stores its reference: the matmuls cast them anyway, so no value changes,
and with bf16 compute over fp32 weights it takes half the memory; norms stay fp32).

**What it computes.** Per generated token ``y_t`` of each sample: ``log π_T(y_t | y_<t)``,
the teacher's full softmax at the run's sampling temperature (the student's logprobs are
tempered alike, so the reverse KL is 0 exactly where the two tempered distributions agree),
by the learner's logprob program (``learner.make_compute_logprobs``: the fused logprob
kernel at the loss positions only, over packed rows), and whether the teacher's argmax at
that position is another token than ``y_t``.

**The argmax, and what it costs.** The fused kernel returns logprobs only, so the same
program takes a chunked jnp pass over the teacher's logits at the gathered loss positions
(:func:`mark_other_argmax`): ``[chunk, D] @ [D, V]`` then argmax, ``CHUNK_LOGITS``
fp32 logits (16 MiB) at a time (``algos.teacher_divergence.over_position_chunks``). That
is one more head matmul per loss token, the same
``D·V`` multiply-adds as the kernel's own pass over the head: 74 k at the tiny model's
128 × 576 head against its blocks' ~0.8 M per token (+9%), 136 M at Qwen2.5-0.5B's
896 × 151,936 head against its blocks' ~360 M (+38%); prompt tokens, which run the blocks
but not the head, cost nothing more. The mark leaves the program in the sign of the
logprob, exactly: a token that is not the argmax has ``p ≤ ½``, so
``log p ≤ −log 2 < 0``, and ``v = −log p > 0`` marks it while ``v = min(log p, 0) ≤ 0`` is
an argmax; :meth:`Teacher.judge` decodes ``(−|v|, v > 0)``.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from jaxrl_agentic.algos.teacher_divergence import (
    DISTILL_LOSSES,
    head_logits,
    over_position_chunks,
)
from jaxrl_agentic.data import Sample
from jaxrl_agentic.models.config import DTYPES
from jaxrl_agentic.models.transformer import in_compute_dtype
from jaxrl_agentic.runtime.parallel import (
    place,
    stacked_layer_dims,
    train_state_shardings,
)
from jaxrl_agentic.training.learner import LOGPROB_BATCH_KEYS, make_compute_logprobs
from jaxrl_agentic.training.learner_config import LearnerConfig
from jaxrl_agentic.training.per_token import per_sample_outputs
from pallas_kernels import compiler_options

DISTILL_MODES = ("add", "only")


@dataclasses.dataclass(frozen=True)
class DistillationConfig:
    """``teacher``: the teacher's source ("" = no distillation); ``dtype``: its compute
    dtype; ``coef``: β; ``mode``: "add" (to the shaped task advantage) or "only";
    ``center``: subtract the batch's mean reverse KL (``pipeline/distillation.py``);
    ``loss``: one of ``DISTILL_LOSSES`` ("sampled": β scales that advantage; a divergence:
    β scales it in the learner's loss, and the advantage is the task's, or 0 under "only").
    Errors name the run-config fields."""

    teacher: str = ""
    dtype: str = "float32"
    coef: float = 1.0
    mode: str = "add"
    center: bool = False
    loss: str = "sampled"

    def __post_init__(self):
        if self.loss not in DISTILL_LOSSES:
            raise ValueError(f"distill_loss: {self.loss!r} is not allowed; choose one of "
                             f"{', '.join(DISTILL_LOSSES)}")
        if self.mode not in DISTILL_MODES:
            raise ValueError(f"distill_mode: {self.mode!r} is not allowed; choose one of "
                             f"{', '.join(DISTILL_MODES)}")
        if isinstance(self.coef, bool) or not isinstance(self.coef, int | float) \
                or not np.isfinite(self.coef) or self.coef < 0:
            raise ValueError(f"distill_coef: must be a number >= 0, got {self.coef!r}")
        if self.mode == "only" and self.coef == 0:
            raise ValueError("distill_coef: 0 with distill_mode='only' leaves every "
                             "advantage 0 (nothing to learn); use a coefficient > 0")
        if not isinstance(self.center, bool):
            raise ValueError(f"distill_center: must be True or False, got {self.center!r}")
        if self.dtype not in DTYPES:
            raise ValueError(f"teacher.dtype: {self.dtype!r} is not allowed; choose one of "
                             f"{', '.join(DTYPES)} (or '' for the student's dtype)")

    @property
    def enabled(self) -> bool:
        return bool(self.teacher)

    @property
    def dense(self) -> bool:
        """Whether the learner's loss holds the teacher's whole distribution."""
        return self.enabled and self.loss != "sampled"


def mark_other_argmax(hidden, head, targets, logprobs):
    """``logprobs [N]`` with the sign of each position flipped where the argmax of
    ``hidden @ head`` is not ``targets`` (module doc: exact, and its cost)."""
    def best(chunk):
        return jnp.argmax(head_logits(chunk[0], head), axis=-1)

    other = over_position_chunks(best, (hidden,), head.shape[1]) != targets
    return jnp.where(other, -logprobs, jnp.minimum(logprobs, 0.0))


class Teacher:
    """A frozen model's per-token judgement of packed samples (module doc). ``graphdef``,
    ``params`` (on the host or on ``mesh``): the teacher's model, stored here with its
    matrices in compute ``dtype`` and placed by the parameter partition rules;
    ``config``: the learner's (packing, temperature, kernels, remat)."""

    def __init__(self, graphdef, params, dtype: str, config: LearnerConfig, mesh):
        params = jax.tree_util.tree_map_with_path(
            lambda path, x: in_compute_dtype(x, dtype, stacked_layer_dims(path)), params)
        self.shardings = shardings = train_state_shardings(params, mesh)
        self.graphdef, self.params, self.mesh = graphdef, place(params, shardings), mesh
        self.packing = config.packing
        self.keys = config.packing.batch_keys(LOGPROB_BATCH_KEYS)
        self._compute = make_compute_logprobs(
            graphdef, config, mesh, shardings, compiler_options(dtype),
            logprob_filter=(0, 1.0), mark=mark_other_argmax)

    @property
    def model_config(self):
        return nnx.merge(self.graphdef, self.params).cfg

    def judge(self, samples: Sequence[Sample]) -> list[tuple[np.ndarray, np.ndarray]]:
        """Per sample ``(teacher logprobs [L], prefers_other [L] bool)``: 0 / False on the
        first token and beyond ``sequence_length``; read them on loss tokens only."""
        signed = per_sample_outputs(samples, self.packing, self.mesh, self._compute,
                                    self.params, self.keys)
        return [(-np.abs(v), v > 0) for v in signed]
