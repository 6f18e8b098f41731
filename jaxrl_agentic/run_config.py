"""The run config tree: the one place the flat ``ConfigDict`` becomes typed configs.

Users write recipes and ``--config.x=y`` overrides against the flat ml_collections dict
(``config.py``: defaults and one-line validation). :func:`build_run_config` maps it, once,
onto :class:`RunConfig`, a tree of frozen dataclasses, one per part::

    RunConfig
    ├── run        RunSettings         output paths, step counts, seed, resume
    ├── model      ModelSettings       which checkpoint, its dtypes, LoRA
    ├── envs       {tag: EnvSettings}  each environment tag, with its GenerationConfig
    ├── train/val  EnvSplit            EnvManagerConfig + the split's env_config overrides
    ├── rollout    RolloutSettings     prompts, rollout schedule, async, dynamic sampling
    ├── advantages AdvantageConfig     estimator, sample mode, reward shaping, filters
    ├── learner    LearnerConfig       policy loss, optimizer, packing (training/)
    ├── critic     CriticConfig | None value model (gae)
    ├── distillation DistillationConfig  on-policy distillation's teacher
    ├── schedule   ScheduleConfig      learning-rate plan
    ├── format_warmup, mesh, distributed

Every module past the entry points (``train``, ``evaluate``, ``play``) reads the tree, not
the dict. Each part validates its own rules in its dataclass (``ValueError("<field>:
<why>")``); :func:`check_typed_configs` builds them all so that ``config.validate``
reports those rules as ``config.<field>: <why>`` without a second copy of any rule. The
typed configs' defaults equal ``config.default_config()``'s (a test holds them to it).
"""

from __future__ import annotations

import dataclasses
import os
from collections.abc import Mapping

from jaxrl_agentic.algos.estimators import AdvantageSettings, get_advantage_estimator
from jaxrl_agentic.data import PackingConfig
from jaxrl_agentic.env_specific import resolve_env_specific
from jaxrl_agentic.models.lora import LoRAConfig
from jaxrl_agentic.rollout.groups import EnvManagerConfig
from jaxrl_agentic.rollout.history import FULL, HistoryPolicy, parse_history
from jaxrl_agentic.rollout.turns import GenerationConfig
from jaxrl_agentic.training.critic import CriticConfig
from jaxrl_agentic.training.learner_config import LearnerConfig
from jaxrl_agentic.training.teacher import DistillationConfig


def generation_budget(c, sample_mode: str | None = None) -> int:
    """Most tokens a sample can generate: the largest ``max_tokens_per_step`` over the
    envs, times their ``max_turns`` when a sample is the whole trajectory (``sample_mode``,
    default the run's)."""
    whole_episode = (sample_mode or c.sample_mode) == "trajectory"
    return max(spec.max_tokens_per_step * (spec.max_turns if whole_episode else 1)
               for spec in c.custom_envs.values())


def loss_slots(c) -> int:
    """Loss tokens a packed row may hold: ``micro_batch_max_loss_tokens``, or automatically
    a quarter of the row (replies are a small part of a multi-turn sample: the chat
    template, observations and the growing context are not), at least the most tokens one
    sample generates (``max_turns · max_tokens_per_step``, so every sample fits a row),
    rounded up to a multiple of 64 and at most the row."""
    row = c.micro_batch_max_tokens
    if c.micro_batch_max_loss_tokens:
        return min(c.micro_batch_max_loss_tokens, row)
    # A whole episode's replies in any sample mode: merged step samples can hold them all.
    return auto_loss_slots(row, generation_budget(c, "trajectory"))


def auto_loss_slots(row: int, budget: int = 0) -> int:
    """The automatic loss slots of a ``row``-token row: a quarter of it, at least
    ``budget``, rounded up to a multiple of 64 and at most the row."""
    return min(row, -(-max(row // 4, budget) // 64) * 64)


def sample_align(c) -> int:
    """``sample_align``, or automatically the attention block (128) where that makes the
    sampler's bf16 attention bit-identical to the learner's (bf16 compute, block-sparse
    learner attention: CPU) and 1 elsewhere: on GPU/TPU the two run different kernels, and
    in float32 the sides agree to ~1e-6 anyway, so alignment would only cost padding."""
    if c.sample_align:
        return c.sample_align
    from pallas_kernels.segment_attention import BLOCK, resolve_attention_impl

    blocksparse = resolve_attention_impl(c.attention_impl) == "blocksparse"
    return BLOCK if c.dtype == "bfloat16" and blocksparse else 1


def packing_config(c, pad_token_id: int = 0) -> PackingConfig:
    return PackingConfig(
        micro_batch_max_tokens=c.micro_batch_max_tokens,
        sequence_length=c.sequence_length,
        rows_bucket=c.rows_bucket,
        fixed_rows=c.fixed_rows,
        pad_token_id=pad_token_id,
        loss_slots=loss_slots(c),
        row_len_buckets=c.row_len_buckets,
        row_len_ratio=c.row_len_ratio,
        sample_align=sample_align(c),
        row_prefixes=c.row_prefixes,
        align_when_free=c.align_when_free,
        share_group_prefix=c.share_group_prefix,
        group_minibatches=c.group_minibatches,
    )


def _update_fields(c, pad_token_id: int) -> dict:
    return dict(
        max_grad_norm=c.max_grad_norm,
        # 0 means off in the run config, None in the typed one.
        relative_grad_clip=c.relative_grad_clip or None,
        weight_decay=c.weight_decay,
        mini_batch_size=c.mini_batch_size,
        ppo_epochs=c.ppo_epochs,
        seed=c.seed,
        packing=packing_config(c, pad_token_id),
    )


def learner_config(c, pad_token_id: int = 0) -> LearnerConfig:
    # 0 means "off" / "same as pg_clip" in the run config, None in the typed one.
    return LearnerConfig(
        learning_rate=c.learning_rate,
        head_learning_rate=c.head_learning_rate or None,
        loraplus_lr_ratio=c.loraplus_lr_ratio,
        loss_reduction=c.loss_reduction,
        pg_clip=c.pg_clip,
        pg_clip_high=c.pg_clip_high or None,
        dual_clip=c.dual_clip or None,
        init_kl_coef=c.init_kl_coef,
        target_kl=c.target_kl or None,
        kl_horizon=c.kl_horizon,
        kl_estimator=c.kl_estimator,
        kl_in_reward=c.kl_in_reward,
        entropy_loss_coef=c.entropy_loss_coef,
        temperature=c.generation.temperature,
        recompute_old_logprobs=c.recompute_old_logprobs,
        tis_imp_ratio_cap=c.tis_imp_ratio_cap,
        tis_level=c.tis_level,
        tis_mode=c.tis_mode,
        tis_lower_cap=c.tis_lower_cap or None,
        cispo_clip_low=c.cispo_clip_low,
        cispo_clip_high=c.cispo_clip_high,
        policy_loss=c.policy_loss,
        loss_norm_length=(c.loss_norm_length or generation_budget(c)
                          if c.loss_reduction == "seq_mean_token_sum_norm" else None),
        top_k=c.generation.top_k,
        top_p=c.generation.top_p,
        logprob_under_sampling_filter=c.logprob_under_sampling_filter,
        kernel_impl=c.kernel_impl,
        attention_impl=c.attention_impl,
        remat=c.remat,
        # The learner scores the teacher's whole distribution only for a dense loss; the
        # sampled estimator is an advantage (pipeline/distillation.py).
        distill_loss=c.distill_loss if c.teacher.pretrain else "sampled",
        distill_coef=c.distill_coef,
        **_update_fields(c, pad_token_id),
    )


def critic_config(c, pad_token_id: int = 0) -> CriticConfig:
    return CriticConfig(
        learning_rate=c.critic_learning_rate,
        value_clip=c.value_clip or None,
        **_update_fields(c, pad_token_id),
    )


def env_manager_config(m, num_return_sequences: int = 1) -> EnvManagerConfig:
    """`num_return_sequences` samples per initial state = that many episodes per group
    member: the multi-turn analogue of several completions per prompt."""
    return EnvManagerConfig(
        num_env_groups=m.num_env_groups,
        group_size=m.group_size * num_return_sequences,
        tags=tuple(m.tags),
        num_groups_partition=tuple(m.num_groups_partition),
    )


def generation_config(c, spec) -> GenerationConfig:
    """Sampling settings of one environment tag (`spec` = `custom_envs[tag]`)."""
    g = c.generation
    return GenerationConfig(max_tokens_per_step=spec.max_tokens_per_step,
                            temperature=g.temperature, top_p=g.top_p, top_k=g.top_k,
                            stop_token_ids=tuple(g.stop_token_ids))


def lora_config(c) -> LoRAConfig:
    """`lora_train_head="auto"` decides from what loading does (`loading_unties_head`), read
    from the checkpoint only then (LoRA on, "auto", `untie_word_embeddings`)."""
    decides = c.lora_rank and c.lora_train_head == "auto" and c.untie_word_embeddings
    return LoRAConfig(rank=c.lora_rank, alpha=c.lora_alpha, targets=tuple(c.lora_targets),
                      train_head=c.lora_train_head,
                      untied_head=bool(decides) and loading_unties_head(c),
                      train_embedding=c.lora_train_embedding)


def loading_unties_head(c) -> bool:
    """Whether loading `c.pretrain` gives it an output head of its own, a copy of its tied
    embedding: `untie_word_embeddings` is set and the checkpoint ties its head (its
    `tie_word_embeddings`; the built-in tiny models do). An untied checkpoint (Qwen2.5-7B)
    loads as it is: its head is its own, and "auto" leaves it frozen beside LoRA.

    The checkpoint is the one named, not the format warm-up's copy (saved untied). A source
    that cannot be read gives False: loading it fails, and `validate` names `pretrain`."""
    from jaxrl_agentic.models.hf_io import read_model_config
    from jaxrl_agentic.models.tiny import PRETRAINED_NAMES, tiny_model_config

    if not c.untie_word_embeddings:
        return False
    if c.pretrain in PRETRAINED_NAMES:  # known without building them
        return tiny_model_config(vocab_size=64).tie_word_embeddings
    try:
        directory = ModelSettings(pretrain=c.pretrain).directory()
        return read_model_config(directory).tie_word_embeddings
    except (ValueError, OSError):  # hf_io.CheckpointError is a ValueError
        return False


def distillation_config(c) -> DistillationConfig:
    """The teacher and its objective (``teacher.dtype`` "" = the student's ``dtype``)."""
    return DistillationConfig(teacher=c.teacher.pretrain, dtype=c.teacher.dtype or c.dtype,
                              coef=c.distill_coef, mode=c.distill_mode,
                              center=c.distill_center, loss=c.distill_loss)


def check_typed_configs(c, fail) -> None:
    """Builds every typed config of run config `c`; the first rule one breaks is reported as
    `fail(run-config field, why)`."""
    builders = [("", lambda: learner_config(c)), ("", lambda: lora_config(c)),
                ("", lambda: distillation_config(c))]
    if get_advantage_estimator(c.adv_estimator).needs_critic:
        builders.append(("", lambda: critic_config(c)))
    for name in ("train_env_manager", "val_env_manager"):
        n = c.generation.num_return_sequences if name == "train_env_manager" else 1
        builders.append((f"{name}.", lambda name=name, n=n: env_manager_config(c[name], n)))
    for tag, spec in c.custom_envs.items():  # "history: <why>" (rollout/history.py)
        builders.append((f"custom_envs.{tag}.",
                         lambda spec=spec: parse_history(spec.get("history", "full"))))
    for prefix, build in builders:
        try:
            build()
        except ValueError as e:
            field, _, why = str(e).partition(": ")
            fail(prefix + field, why)
    check_context(c, fail)


def check_context(c, fail) -> None:
    """`mesh.context` > 1 against the rows it splits: one row length (the zigzag layout's
    chunks are whole attention blocks of it) and a loss without per-sample runs of tokens
    (`pallas_kernels.context_attention`, `training/context_rows.py`)."""
    from pallas_kernels.context_attention import context_length_error

    shards = c.mesh.get("context", 1)
    if not isinstance(shards, int) or isinstance(shards, bool) or shards < 1:
        fail("mesh.context", f"must be an integer >= 1, got {shards!r}")
    if shards == 1:
        return
    if problem := context_length_error(c.micro_batch_max_tokens, shards):
        fail("micro_batch_max_tokens", problem)
    if c.row_len_buckets != 1:
        fail("row_len_buckets", f"mesh.context={shards} splits rows of one length "
             "(micro_batch_max_tokens); set row_len_buckets=1")
    if c.policy_loss == "gspo":  # its ratio is a mean over each sample's run of tokens
        fail("policy_loss", f"'gspo' averages each sample's ratio over one run of tokens, "
             f"which mesh.context={shards} splits over devices; use ppo or cispo")


# ---- the tree ---------------------------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class RunSettings:
    """What the training program does around the steps: output paths (defaults filled in),
    how many steps, how often to evaluate, log and save, and where to resume from."""

    exp_name: str = "default"
    seed: int = 0
    output_dir: str = "outputs/default"
    logging_dir: str = "outputs/default/tensorboard"
    render_save_dir: str = "outputs/default/renders"
    max_steps: int = 100
    save_steps: int = 20
    save_total_limit: int = 3  # checkpoints kept (0: all)
    logging_steps: int = 1
    eval_steps: int = 10
    eval_before_training: bool = False
    eval_transcripts: int = 3
    resume_from_checkpoint: str = ""
    debug_dump_dir: str = ""


@dataclasses.dataclass(frozen=True)
class ModelSettings:
    """The checkpoint to start from (``"tiny"``, ``"tiny-tools"``: built-in models) and its
    compute/parameter dtypes."""

    pretrain: str = "tiny"
    dtype: str = "float32"
    param_dtype: str = "float32"
    untie_word_embeddings: bool = False
    lora: LoRAConfig = LoRAConfig()

    def directory(self) -> str:
        """The HF directory of ``pretrain`` (``"tiny"`` → the cached default model,
        ``"tiny-tools"`` → the tool recipes' variant, each built on first use; a ``.gguf``
        file or a packaged model's name → its converted copy in the cache)."""
        from jaxrl_agentic.models.sources import hf_directory
        from jaxrl_agentic.models.tiny import pretrained_dir

        return pretrained_dir(self.pretrain) or hf_directory(self.pretrain)


@dataclasses.dataclass(frozen=True)
class EnvSettings:
    """One environment tag of ``custom_envs`` (``config.env_spec`` documents each field)."""

    tag: str
    env_type: str
    env_config: Mapping
    max_turns: int
    max_tokens_per_step: int
    format_penalty: float
    backend: str
    step_timeout_s: float
    max_workers: int
    generation: GenerationConfig
    # What the next prompt holds once the whole history would not fit (rollout/history.py).
    # Not in `record`: the format warm-up, whose cache key that is, plays the full history.
    history: HistoryPolicy = FULL

    def record(self) -> dict:
        """The tag's fields under their run-config names (a cache key's content)."""
        return dict(env_type=self.env_type, env_config=dict(self.env_config),
                    max_turns=self.max_turns, max_tokens_per_step=self.max_tokens_per_step,
                    format_penalty=self.format_penalty, env_backend=self.backend,
                    step_timeout_s=self.step_timeout_s, env_max_workers=self.max_workers)


@dataclasses.dataclass(frozen=True)
class EnvSplit:
    """The episodes of one split (train or val) and the environment parameters the split
    overrides on top of each tag's own."""

    manager: EnvManagerConfig
    env_config: Mapping = dataclasses.field(default_factory=dict)


@dataclasses.dataclass(frozen=True)
class RolloutSettings:
    """How episodes are played: prompts and replies, the rollout schedule, asynchronous
    generation, evaluation's decoding and DAPO's dynamic sampling."""

    max_input_length: int = 1024
    system_prompt: str = ""
    reply_prefix: str = ""
    reply_suffix: str = ""
    sampler_backend: str = "jax"
    batching: str = "turn"
    slots: int = 0
    decode_chunk_tokens: int = 8
    precompile: bool = True
    async_generation_ratio: int = 0
    in_flight_updates: bool = False
    max_policy_lag: int = 1
    logprob_under_sampling_filter: bool = False
    eval_temperature: float = 0.0
    dynamic_sampling: bool = False
    dynamic_sampling_max_rounds: int = 3


@dataclasses.dataclass(frozen=True)
class AdvantageConfig:
    """Rewards → advantages → samples: the estimator and its settings, the sample layout,
    the shaping of rewards (KL, overlong punishment) and of advantages."""

    estimator: str = "grpo"
    sample_mode: str = "trajectory"
    merge_stepwise: bool = False
    reward_norm_by: str = "group"
    settings: AdvantageSettings = AdvantageSettings()
    whiten: bool = False
    clip: float = 0.0
    kl_in_reward: bool = False
    kl_estimator: str = "k3"
    overlong_filter: bool = False
    overlong_penalty: float = 1.0
    overlong_penalty_length: int = 0


@dataclasses.dataclass(frozen=True)
class ScheduleConfig:
    """The learning-rate plan (``algos/schedules.py``)."""

    learning_rate: float = 1e-5
    lr_scheduler_type: str = "constant"
    warmup_steps: int = 0
    min_lr_ratio: float = 0.0
    estimated_chunks_per_traj: float = 0


@dataclasses.dataclass(frozen=True)
class FormatWarmupConfig:
    """Supervised replies with random valid actions before RL (``warmup.py``)."""

    steps: int = 0
    learning_rate: float = 2e-3
    episodes_per_step: int = 16
    max_turns: int = 2
    # "constant", or "cosine": from learning_rate down to a tenth of it at the last step
    lr_schedule: str = "constant"
    # Replies drawn at random instead of the environment's own warm-up policy (empty: its own)
    replies: tuple[str, ...] = ()


@dataclasses.dataclass(frozen=True)
class MeshSettings:
    data: int = -1
    fsdp: int = 1
    tensor: int = 1
    context: int = 1
    sampler_devices: int = 0
    cpu_devices: int = 1


@dataclasses.dataclass(frozen=True)
class DistributedSettings:
    enabled: bool = False
    coordinator_address: str = ""
    num_processes: int = 0
    process_id: int = -1


@dataclasses.dataclass(frozen=True)
class RunConfig:
    """The whole run, typed (the module docstring draws the tree). ``source_json`` is the
    flat config as the user gave it: written to the run's ``config.json``, from which
    ``run_loading`` rebuilds the run; no value is read from it."""

    run: RunSettings
    model: ModelSettings
    envs: Mapping[str, EnvSettings]
    train: EnvSplit
    val: EnvSplit
    rollout: RolloutSettings
    advantages: AdvantageConfig
    learner: LearnerConfig
    critic: CriticConfig | None
    schedule: ScheduleConfig
    format_warmup: FormatWarmupConfig
    mesh: MeshSettings
    distributed: DistributedSettings
    source_json: str = "{}"
    distillation: DistillationConfig = DistillationConfig()

    @property
    def max_turns(self) -> int:
        """The most turns any environment plays."""
        return max(e.max_turns for e in self.envs.values())

    @property
    def max_tokens_per_step(self) -> int:
        """The longest reply any environment allows."""
        return max(e.max_tokens_per_step for e in self.envs.values())

    def split(self, name: str) -> EnvSplit:
        """``"train"`` or ``"val"``."""
        return {"train": self.train, "val": self.val}[name]

    def split_env_config(self, split: str, tag: str) -> dict:
        """The environment parameters of tag ``tag``'s episodes in ``split``: the tag's own,
        then the split's overrides."""
        return {**dict(self.envs[tag].env_config), **dict(self.split(split).env_config)}

    def with_pad_token_id(self, pad_token_id: int) -> RunConfig:
        """This config with the tokenizer's pad id in the packing of learner and critic
        (known once the tokenizer is loaded)."""
        def repack(part):
            packing = dataclasses.replace(part.packing, pad_token_id=pad_token_id)
            return dataclasses.replace(part, packing=packing)

        return dataclasses.replace(self, learner=repack(self.learner),
                                   critic=None if self.critic is None else repack(self.critic))


def mesh_settings(c) -> MeshSettings:
    return MeshSettings(**{f.name: c.mesh.get(f.name, f.default)
                           for f in dataclasses.fields(MeshSettings)})


def distributed_settings(c) -> DistributedSettings:
    return DistributedSettings(**dict(c.distributed))


def _env_settings(c, tag: str, spec) -> EnvSettings:
    return EnvSettings(
        tag=tag, env_type=c.get("env_id") or spec.env_type, env_config=dict(spec.env_config),
        max_turns=spec.max_turns, max_tokens_per_step=spec.max_tokens_per_step,
        format_penalty=spec.format_penalty, backend=spec.get("env_backend", "auto"),
        step_timeout_s=float(spec.get("step_timeout_s", 0.0)),
        max_workers=spec.get("env_max_workers", 0), generation=generation_config(c, spec),
        history=parse_history(spec.get("history", "full")))


def build_run_config(c) -> RunConfig:
    """The tree of a (validated) flat run config: the one place its fields are read, as
    the run plays them (`env_specific.resolve_env_specific`)."""
    c = resolve_env_specific(c)
    out = c.output_dir or os.path.join("outputs", c.exp_name)
    run = RunSettings(
        exp_name=c.exp_name, seed=c.seed, output_dir=out,
        logging_dir=c.logging_dir or os.path.join(out, "tensorboard"),
        render_save_dir=c.render_save_dir or os.path.join(out, "renders"),
        max_steps=c.max_steps, save_steps=c.save_steps, save_total_limit=c.save_total_limit,
        logging_steps=c.logging_steps,
        eval_steps=c.eval_steps, eval_before_training=c.eval_before_training,
        eval_transcripts=c.eval_transcripts,
        resume_from_checkpoint=c.resume_from_checkpoint,
        debug_dump_dir=c.debug.dump_dir)
    splits = {}
    for split, name in (("train", "train_env_manager"), ("val", "val_env_manager")):
        n = c.generation.num_return_sequences if split == "train" else 1
        splits[split] = EnvSplit(env_manager_config(c[name], n),
                                 dict(c[name].get("env_config", {})))
    return RunConfig(
        run=run,
        model=ModelSettings(pretrain=c.pretrain, dtype=c.dtype, param_dtype=c.param_dtype,
                            untie_word_embeddings=c.untie_word_embeddings,
                            lora=lora_config(c)),
        envs={tag: _env_settings(c, tag, spec) for tag, spec in c.custom_envs.items()},
        train=splits["train"], val=splits["val"],
        rollout=RolloutSettings(
            max_input_length=c.max_input_length, system_prompt=c.system_prompt,
            reply_prefix=c.reply_prefix, reply_suffix=c.reply_suffix,
            sampler_backend=c.sampler_backend,
            batching="continuous" if c.in_flight_updates else c.rollout_batching,
            slots=c.rollout_slots,
            decode_chunk_tokens=c.decode_chunk_tokens, precompile=c.rollout_precompile,
            async_generation_ratio=c.async_generation_ratio,
            in_flight_updates=c.in_flight_updates, max_policy_lag=c.max_policy_lag,
            logprob_under_sampling_filter=c.logprob_under_sampling_filter,
            eval_temperature=c.eval_temperature, dynamic_sampling=c.dynamic_sampling,
            dynamic_sampling_max_rounds=c.dynamic_sampling_max_rounds),
        advantages=AdvantageConfig(
            estimator=c.adv_estimator, sample_mode=c.sample_mode,
            merge_stepwise=c.merge_stepwise, reward_norm_by=c.reward_norm_by,
            settings=AdvantageSettings(use_std=c.norm_adv_std,
                                       step_reward_gamma=c.step_reward_gamma,
                                       gigpo_step_weight=c.gigpo_step_weight, gamma=c.gamma,
                                       lambd=c.lambd),
            whiten=c.whiten_advantages, clip=c.advantage_clip, kl_in_reward=c.kl_in_reward,
            kl_estimator=c.kl_estimator, overlong_filter=c.overlong_filter,
            overlong_penalty=c.overlong_penalty,
            overlong_penalty_length=c.overlong_penalty_length),
        learner=learner_config(c),
        critic=(critic_config(c) if get_advantage_estimator(c.adv_estimator).needs_critic
                else None),
        schedule=ScheduleConfig(
            learning_rate=c.learning_rate, lr_scheduler_type=c.lr_scheduler_type,
            warmup_steps=c.warmup_steps, min_lr_ratio=c.min_lr_ratio,
            estimated_chunks_per_traj=c.estimated_chunks_per_traj),
        format_warmup=FormatWarmupConfig(**{**dict(c.format_warmup),
                                            "replies": tuple(c.format_warmup.replies)}),
        mesh=mesh_settings(c),
        distributed=distributed_settings(c),
        source_json=c.to_json_best_effort(indent=2),
        distillation=distillation_config(c))


def as_run_config(c) -> RunConfig:
    """``c`` if it is a :class:`RunConfig`, else the tree of the flat config ``c``."""
    return c if isinstance(c, RunConfig) else build_run_config(c)
