"""On-policy distillation: a teacher's per-token judgement of the student's own episodes.

The student plays its episodes as in RL; a frozen teacher (``training/teacher.py``) then
scores every token the student generated, and each token gets the advantage

    A_t = −β · (log π_s(y_t | y_<t) − log π_T(y_t | y_<t))        (loss mask 1)

the negative of a one-sample estimate of the per-token reverse KL(π_s ‖ π_T) at the
student's own state. There is no bootstrapping across tokens (discount 0): a token is
credited with its own term only, not with the KL of the tokens it leads to, as in GKD
(Agarwal et al. 2024, "On-Policy Distillation of Language Models: Learning from
Self-Generated Mistakes") and Thinking Machines' "On-Policy Distillation" (2025): a dense
signal where the task reward is one number per episode. Its expectation
under π_s is ``−β·KL(π_s ‖ π_T)`` at each state, so the policy gradient with it lowers the
reverse KL of the states the student visits; a token the teacher finds likelier than the
student does gets a positive advantage.

**Which student logprob.** ``log π_s`` is the sampler's logprob of the sampled token: the
samples' ``old_logprobs`` as ``build_samples`` makes them from the rollout, before the
learner recomputes them (``recompute_old_logprobs``) or masks out-of-support ones; that
is the policy that sampled (under ``async_generation_ratio`` or in-flight updates an older
version than the learner's), whose reverse KL the sample estimates. The teacher's is its
full softmax at the run's sampling temperature, as the student's logprob is.

**Which tokens.** Those the learner trains on: loss mask 1 (what the model generated:
observations, tool results, template tokens and a post-hoc EOS are 0), within
``sequence_length`` and with a real logprob on both sides
(``training.off_policy.comparable_masks``). Elsewhere "add" leaves the advantage as it was
and "only" sets it to 0. Trajectory-wise and step-wise samples (merged or not) alike: the
teacher reads each sample's own context.

**Modes.** ``distill_mode="add"``: A_t is added to the task advantage *after* that is
shaped (``whiten_advantages``, ``advantage_clip``). Shaped first, the task advantage keeps
the scale the run chose and β is in its units; shaped together, whitening would subtract
the batch mean of the KL term (the mean penalty every token pays, which is the point) and
divide it by the task advantage's spread, and clipping would cut off the tokens the teacher
disagrees with most, the most informative ones. ``"only"``: A_t alone (pure
distillation); rewards are still played, shaped and logged (``env/*``). β = 0 with "add"
trains on the task alone and logs the teacher's judgement (a monitor).

**The teacher's whole distribution** (``distill_loss`` "forward_kl" / "reverse_kl"): the
learner adds ``β·KL`` over the vocabulary at each of these tokens to its loss instead
(``algos/teacher_divergence.py``, the teacher passed to the ``Learner``); the advantage is
then the task's ("add") or 0 ("only"), and this module still logs the judgement below.

**A baseline** (``distill_center``, off by default as in the references): ``A_t = −β·(d_t −
d̄)`` with ``d_t = log π_s − log π_T`` and ``d̄`` the batch's mean over the tokens above
(``distill/reverse_kl``), a constant baseline (its own token's share of ``d̄`` is 1/N).
Without it, wherever the teacher is less sure than the student the mean advantage is
negative, every sampled token is pushed down, and a small batch spreads the student over the
vocabulary: distilling a fresh tiny student from a FrozenLake-trained tiny teacher (64
episodes a step, one judged token a reply) raised the student's entropy from 1.35 to 3.6 in
19 steps and its reverse KL from 1.2 to 2.4; centred, the entropy fell to 0.73 and the
reverse KL to 0.15 in 30 (docs/algorithms.md, "On-policy distillation").

**Metrics** (over the tokens above): ``distill/reverse_kl`` mean of log π_s − log π_T;
``distill/teacher_logprob`` mean log π_T of the student's tokens;
``distill/teacher_prefers_other`` share where the teacher's argmax is another token;
``distill/tokens`` how many.

**Where a teacher comes from** (``teacher.pretrain``): whatever ``pretrain`` accepts (a
Hugging Face directory, a ``.gguf`` file, a packaged model's name, ``"tiny"``,
``"tiny-tools"``), or a training run (its output directory, ``checkpoints`` directory or one
step's: the policy at the latest checkpoint or that step, LoRA adapters merged, as
``run_loading.run_policy`` restores it, passed in by the entry points). It must share the
student's tokenizer: the same ``get_vocab()``, checked before its weights are read; another
is one ``config.teacher.pretrain`` error line.
"""

from __future__ import annotations

import dataclasses
import os
from collections.abc import Sequence

import numpy as np
from flax import nnx
from jax.sharding import NamedSharding

from jaxrl_agentic.config import ConfigError
from jaxrl_agentic.data import Sample
from jaxrl_agentic.run_paths import is_teacher_run, run_setting
from jaxrl_agentic.runtime.parallel import param_partition_spec
from jaxrl_agentic.training.off_policy import comparable_masks
from jaxrl_agentic.training.teacher import DistillationConfig, Teacher


def distillation_advantages(task: np.ndarray, student_logprobs: np.ndarray,
                            teacher_logprobs: np.ndarray, mask: np.ndarray, coef: float,
                            mode: str, baseline: float = 0.0) -> np.ndarray:
    """One sample's advantages: ``task + A`` ("add") or ``A`` ("only") where ``mask``, with
    ``A = −coef·(student − teacher − baseline)``; elsewhere ``task`` ("add") or 0 ("only")."""
    distill = -coef * (np.asarray(student_logprobs, np.float64)
                       - np.asarray(teacher_logprobs, np.float64) - baseline)
    task = np.asarray(task, np.float64) if mode == "add" else np.zeros(distill.shape)
    return np.where(mask, task + distill, task).astype(np.float32)


def distill(samples: Sequence[Sample], teacher: Teacher, config: DistillationConfig,
            sequence_length: int | None) -> tuple[list[Sample], dict[str, float]]:
    """``samples`` with the distillation advantages of ``config`` (module doc) from
    ``teacher``'s judgement, and the ``distill/*`` metrics."""
    samples = list(samples)
    if not samples:
        return samples, {}
    judged = teacher.judge(samples)
    masks = comparable_masks(samples, [lp for lp, _ in judged], sequence_length)
    tokens = sum(int(m.sum()) for m in masks)

    def mean(per_sample):
        values = [np.asarray(v, np.float64)[m] for v, m in zip(per_sample, masks, strict=True)]
        return float(np.concatenate(values).sum() / max(tokens, 1))

    reverse_kl = mean([s.old_logprobs - lp for s, (lp, _) in zip(samples, judged, strict=True)])
    baseline = reverse_kl if config.center else 0.0
    # A dense loss carries β in the learner's objective: the advantage is the task's alone.
    coef = 0.0 if config.dense else config.coef
    out = [dataclasses.replace(s, advantages=distillation_advantages(
        s.advantages, s.old_logprobs, lp, mask, coef, config.mode, baseline))
        for s, (lp, _), mask in zip(samples, judged, masks, strict=True)]
    return out, {"distill/reverse_kl": reverse_kl,
                 "distill/teacher_logprob": mean([lp for lp, _ in judged]),
                 "distill/teacher_prefers_other": mean([other for _, other in judged]),
                 "distill/tokens": float(tokens)}


# ---- the teacher's source ---------------------------------------------------------------------
def teacher_model_dir(source: str) -> str:
    """The HF directory of the teacher's tokenizer (and, for a model, weights): for a
    training run, that of the model the run started from."""
    from jaxrl_agentic.run_config import ModelSettings

    pretrain = run_setting(source, "pretrain", "tiny") if is_teacher_run(source) else source
    return ModelSettings(pretrain=pretrain).directory()


def teacher_model_config(config: DistillationConfig):
    """The teacher's ``ModelConfig`` in its compute dtype, from its config.json alone (a
    training run's: that of the model it started from); None without a teacher."""
    from jaxrl_agentic.models.hf_io import read_model_config

    if not config.enabled:
        return None
    # A run that untied its head on load trained (and exports) a head of its own.
    untie = is_teacher_run(config.teacher) and run_setting(config.teacher,
                                                           "untie_word_embeddings", False)
    return read_model_config(teacher_model_dir(config.teacher), config.dtype,
                             untie_word_embeddings=bool(untie))


def check_same_tokenizer(teacher_tokenizer, student_tokenizer, source: str, *,
                         field: str = "config.teacher.pretrain",
                         role: str = "the teacher") -> None:
    """One ``ConfigError`` line unless both tokenizers map the same strings to the same ids
    (`role` at `field`: the teacher, or a two-player game's seat model)."""
    teacher, student = teacher_tokenizer.get_vocab(), student_tokenizer.get_vocab()
    if teacher == student:
        return
    differ = sum(teacher.get(token) != i for token, i in student.items())
    raise ConfigError(
        f"{field}: {source!r} has another tokenizer than the student "
        f"({len(teacher)} tokens against {len(student)}, {differ} of the student's mapped "
        f"otherwise); {role} reads the student's token ids, so it must share its "
        "tokenizer")


def load_teacher(config: DistillationConfig, learner_config, mesh, student_tokenizer,
                 *, run_policy=None, log=print) -> Teacher:
    """The teacher of ``config`` on the learner's ``mesh``; its tokenizer is checked against
    the student's before any of its weights is read. A training run as the teacher is
    restored by ``run_policy(path) -> (model, tokenizer)``
    (``run_loading.run_policy``, which builds that run's own pipeline: the entry points pass
    it, so this layer does not import the one above it)."""
    from jaxrl_agentic.models.hf_io import load_pretrained, load_tokenizer
    from jaxrl_agentic.models.transformer import Transformer

    source = config.teacher
    directory = teacher_model_dir(source)
    check_same_tokenizer(load_tokenizer(directory), student_tokenizer, source)
    if is_teacher_run(source):  # the run's policy on the host, in the teacher's compute dtype
        if run_policy is None:
            raise ConfigError(f"config.teacher.pretrain: {source} is a training run; a "
                              "Pipeline built in code restores it with "
                              "Pipeline(config, run_policy=jaxrl_agentic.run_loading.run_policy)"
                              " (train, evaluate, export and play pass it)")
        model, _ = run_policy(os.path.expanduser(source))
        cfg = dataclasses.replace(model.cfg, dtype=config.dtype)
        graphdef = nnx.split(nnx.eval_shape(lambda: Transformer(cfg, rngs=nnx.Rngs(0))))[0]
        params = nnx.state(model)
    else:
        def shardings(path, shape):  # read straight into its shards, as the student is
            return NamedSharding(mesh, param_partition_spec(path, shape, mesh.shape))

        graphdef, params = nnx.split(load_pretrained(directory, dtype=config.dtype,
                                                     param_dtype="float32",
                                                     shardings=shardings)[0])
    teacher = Teacher(graphdef, params, config.dtype, learner_config, mesh)
    cfg = teacher.model_config
    log(f"teacher: {source} ({cfg.num_hidden_layers} layers, hidden {cfg.hidden_size}), "
        f"frozen on the learner's mesh in {config.dtype}")
    return teacher
