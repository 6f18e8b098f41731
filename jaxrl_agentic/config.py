"""Configuration: defaults, recipe loading helpers and validation with one-line errors.

Field names follow the common agentic-RL pipelines so their users find their way. Every
field is documented in docs/configuration.md. `validate(config)` raises `ConfigError` with
one line naming the field and what is allowed; the CLI prints it and exits with code 2.
"""

from __future__ import annotations

import difflib
import os

import ml_collections

# Each choice's list is the one of the module that implements it: a new estimator, reduction
# or schedule is allowed here once it exists there. The rules of the parts' own settings are
# checked once, by their typed configs (run_config.check_typed_configs).
from jaxrl_agentic.algos.estimators import REWARD_NORM_BY, estimator_names, validate_estimator
from jaxrl_agentic.algos.schedules import LR_SCHEDULER_TYPES
from jaxrl_agentic.data.samples import SAMPLE_MODES
from jaxrl_agentic.env_specific import env_specific_settings, resolve_env_specific  # noqa: F401
from jaxrl_agentic.models.config import DTYPES
from jaxrl_agentic.rollout.batching import ROLLOUT_BATCHING


class ConfigError(ValueError):
    """A configuration value that cannot work; the message is one line naming the field."""


# "auto": the backend the environment was registered on (envs/registry.py).
ENV_BACKENDS = ("auto", "jax", "python")

WARMUP_LR_SCHEDULES = ("constant", "cosine")


def env_spec(env_type: str, max_turns: int = 10, max_tokens_per_step: int = 64,
             format_penalty: float = 0.1, env_backend: str = "auto", step_timeout_s: float = 60.0,
             env_max_workers: int = 0, history: str = "full", **env_config
             ) -> ml_collections.ConfigDict:
    """`env_backend="python"`: host-side environments stepped in a thread pool, each step
    with a deadline of `step_timeout_s` (0 = none; a late or raising call ends its episode,
    counted); see rollout/python_runner.py. `history`: rollout/history.py."""
    return ml_collections.ConfigDict(dict(
        env_type=env_type,
        env_config=dict(env_config),
        max_turns=max_turns,
        max_tokens_per_step=max_tokens_per_step,
        format_penalty=format_penalty,
        env_backend=env_backend,
        step_timeout_s=float(step_timeout_s),
        env_max_workers=env_max_workers,
        history=history,
    ))


def tiny_grpo_recipe(exp_name: str, reply_prefix: str, reply_suffix: str):
    """The settings the tiny model's recipes on other libraries' environments share
    (`configs/textarena.py`, `configs/reasoning_gym.py`): GRPO over trajectory samples, a
    cosine schedule from 1e-3, a light KL, an untied head, one JAX device per core, the
    reply's tags as context (the model writes only what goes between), and a short format
    warm-up (`warmup.text_policy`: a game's example actions, a dataset's answers to other
    items), without which the random tiny model rarely ends a reply in time."""
    c = default_config()
    c.exp_name, c.pretrain = exp_name, "tiny"
    c.adv_estimator, c.sample_mode = "grpo", "trajectory"
    c.max_steps, c.save_steps, c.eval_steps = 100, 25, 10
    c.learning_rate, c.lr_scheduler_type, c.warmup_steps, c.min_lr_ratio = 1e-3, "cosine", 5, 0.1
    c.mini_batch_size, c.init_kl_coef = 16, 0.05
    c.mesh.cpu_devices = 0
    c.reply_prefix, c.reply_suffix = reply_prefix, reply_suffix
    c.format_warmup.steps = 20
    c.untie_word_embeddings = True
    return c


def env_manager(num_env_groups: int, group_size: int, tags=("frozen_lake",),
                num_groups_partition=(), env_config=None) -> ml_collections.ConfigDict:
    """`env_config`: environment parameters that this manager's episodes override on top of
    each tag's `custom_envs[tag].env_config` (e.g. training maps with more holes than the
    held-out ones), so one tag serves both splits and an override of the tag reaches both."""
    return ml_collections.ConfigDict(dict(
        num_env_groups=num_env_groups,
        group_size=group_size,
        tags=tuple(tags),
        num_groups_partition=tuple(num_groups_partition),
        env_config=dict(env_config or {}),
    ))


def recipe_config(path: str) -> ml_collections.ConfigDict:
    """``get_config()`` of the recipe file at ``path``: recipes are loaded by path (they are
    not a package), so a recipe built on another loads that one the same way."""
    import importlib.util

    spec = importlib.util.spec_from_file_location(
        "recipe_" + os.path.splitext(os.path.basename(path))[0], path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module.get_config()


def default_config() -> ml_collections.ConfigDict:
    """Every field with its default; recipes in configs/ override what they need."""
    c = ml_collections.ConfigDict()
    # run
    c.exp_name = "default"
    c.seed = 0
    c.output_dir = ""  # "" → outputs/<exp_name>
    c.logging_dir = ""  # "" → <output_dir>/tensorboard
    c.render_save_dir = ""  # "" → <output_dir>/renders
    c.max_steps = 100
    c.save_steps, c.save_total_limit = 20, 3  # checkpoints kept: the newest 3 (0: all)
    c.logging_steps = 1
    c.eval_steps = 10
    # Also evaluate before the first update (step 0): the format warm-up's success alone,
    # the baseline that RL's gain is measured from.
    c.eval_before_training = False
    c.eval_temperature = 0.0  # 0 = greedy; > 0 samples the eval replies at this temperature
    # Held-out episodes written out turn by turn at every eval (TensorBoard text
    # episodes/eval_transcripts and <output_dir>/transcripts/eval_step_N.txt); 0 = none.
    c.eval_transcripts = 3
    c.resume_from_checkpoint = ""  # a checkpoint path, or "latest"
    # model
    c.pretrain = "tiny"  # a local HF directory, or "tiny" for the built-in default model
    c.dtype = "float32"
    c.param_dtype = "float32"
    # A tied checkpoint gets its own output head (a copy of the embedding) before training:
    # docs/algorithms.md, "Tied embeddings and generated format tokens".
    c.untie_word_embeddings = False
    # LoRA (models/lora.py): adapters of rank lora_rank on the lora_targets projections
    # (() = all of q/k/v/o and gate/up/down), scaled by lora_alpha / lora_rank (alpha 0 = rank);
    # only they are trained, the base stays frozen and is the KL reference. 0 = off.
    c.lora_rank = 0
    c.lora_alpha = 0.0
    c.lora_targets = ()
    # the output head trains in full beside the adapters: "auto" (when untie_word_embeddings
    # made it a copy of a tied embedding), "always" (an untied head), "never"
    c.lora_train_head = "auto"
    # the token embedding trains in full beside the adapters (PEFT's modules_to_save)
    c.lora_train_embedding = False
    # LoRA+: the B adapters' LR as a multiple of learning_rate (1 = off; training/update.py)
    c.loraplus_lr_ratio = 1.0
    # algorithm
    c.adv_estimator = "grpo"
    c.sample_mode = "trajectory"
    c.merge_stepwise = False
    c.reward_norm_by = "group"
    c.norm_adv_std = True
    c.whiten_advantages = False
    c.advantage_clip = 0.0  # 0 = off; else clip advantages to [-c, c]
    c.gamma = 1.0
    c.lambd = 0.95
    c.step_reward_gamma = 0.95
    c.gigpo_step_weight = 1.0
    c.ppo_epochs = 1
    c.pg_clip = 0.2
    c.pg_clip_high = 0.0  # 0 = same as pg_clip
    c.dual_clip = 0.0  # 0 = off; else c (≈ 3)
    # CISPO's own weight bounds clip(r, 1 − low, 1 + high): low ≥ 1 = none (MiniMax-M1)
    c.cispo_clip_low = 1.0
    c.cispo_clip_high = 0.28
    c.init_kl_coef = 0.0
    c.target_kl = 0.0  # 0 = fixed coefficient
    c.kl_horizon = 10000.0  # adaptive KL: samples over which β moves by at most ±20%
    c.kl_estimator = "k3"
    c.kl_in_reward = False
    c.entropy_loss_coef = 0.0
    c.loss_reduction = "token_mean"
    c.policy_loss = "ppo"  # ppo | gspo | cispo | registered (algos/policy_losses.py)
    # seq_mean_token_sum_norm's constant divisor (Dr. GRPO); 0 = the generation budget
    c.loss_norm_length = 0
    c.recompute_old_logprobs = False
    # off-policy: rollouts may come from a policy up to this many versions old (0 = sync)
    c.async_generation_ratio = 0
    # in-flight weight updates (rollout/producer.py): rollouts run while the learner trains
    # and decode with each new policy from their next chunk on; a step's episodes start only
    # when they cannot end more than max_policy_lag versions behind the learner (0 = the
    # synchronous run). Brings continuous batching (rollout_batching is then "continuous").
    c.in_flight_updates = False
    c.max_policy_lag = 1
    # rollout schedule: "turn" = every running episode generates in one sampler call per turn;
    # "continuous" = a pool of sampler slots, each episode moving on its own
    # (rollout/continuous.py); same trajectories for the same seeds
    c.rollout_batching = "turn"
    # who generates the replies: "jax" (the in-process sampler) or a registered backend
    # (sampling/backends.py)
    c.sampler_backend = "jax"
    c.rollout_slots = 0  # continuous: sampler slots (KV-cache rows); 0 = one per episode
    c.decode_chunk_tokens = 8  # continuous: decode steps between hand-overs to environments
    # continuous: compile every slot-pool program (chunk widths, prefill rows × tail lengths)
    # at the first rollout, so none compiles later (False: each on first use, fewer in all)
    c.rollout_precompile = True
    # truncated importance weight min(π_old/π_behaviour, cap) on the policy loss (0 = off);
    # needs recompute_old_logprobs (else π_old is the behaviour policy and the weight is 1)
    c.tis_imp_ratio_cap = 0.0
    c.tis_level = "token"  # token | sequence | geometric (algos/importance.py)
    c.tis_mode = "truncate"  # truncate: min(w, cap); mask: drop what leaves [lower, cap]
    c.tis_lower_cap = 0.0  # mask mode's lower bound; 0 = 1 / tis_imp_ratio_cap (verl's)
    # the learner's logprobs under the sampler's top-k / top-p restriction (and the sampler's
    # reported logprobs too), so the ratio is that of the distribution sampled from
    c.logprob_under_sampling_filter = False
    # DAPO: drop groups without reward variance, play more until num_env_groups remain
    c.dynamic_sampling = False
    c.dynamic_sampling_max_rounds = 3  # rounds of num_env_groups groups per step, at most
    c.overlong_filter = False  # DAPO: no loss on samples whose last reply was cut
    # DAPO's soft overlong punishment over the last L_cache tokens of the budget (0 = off)
    c.overlong_penalty_length = 0
    c.overlong_penalty = 1.0
    # on-policy distillation (pipeline/distillation.py): a frozen teacher judges each
    # generated token, advantage −distill_coef·(log π_student − log π_teacher), added to the
    # shaped task advantage ("add") or alone ("only"). teacher.pretrain: "" = none, else what
    # pretrain accepts or a training run's output directory; teacher.dtype: "" = dtype
    c.teacher = ml_collections.ConfigDict(dict(pretrain="", dtype=""))
    c.distill_coef = 1.0
    c.distill_mode = "add"
    c.distill_center = False  # subtract the batch's mean reverse KL (a baseline)
    # sampled (the advantage above) | forward_kl | reverse_kl: the teacher's whole next-token
    # distribution in the loss, distill_coef·D_t a token (algos/teacher_divergence.py)
    c.distill_loss = "sampled"
    c.critic_learning_rate = 1e-5  # gae only: the critic's AdamW learning rate
    c.value_clip = 0.2  # gae only: ε_v of the clipped value loss (0 = unclipped)
    c.kernel_impl = "auto"
    # the training forward's attention over packed rows:
    # auto | reference | blocksparse | pallas | splash (pallas_kernels/segment_attention.py)
    c.attention_impl = "auto"
    # the training forward's rematerialisation: none | layer | dots (models/transformer.py)
    c.remat = "none"
    # optimizer and schedule
    c.learning_rate = 1e-5
    # the output head's own peak LR on the same schedule (0 = learning_rate); it needs a head
    # that trains: untied, and under LoRA trained beside the adapters (lora_train_head)
    c.head_learning_rate = 0.0
    c.lr_scheduler_type = "constant"
    c.warmup_steps = 0
    c.min_lr_ratio = 0.0
    c.weight_decay = 0.0
    c.max_grad_norm = 1.0
    # also clip to this multiple of the typical recent gradient norm (0 = off; training/update.py)
    c.relative_grad_clip = 0.0
    c.mini_batch_size = 32  # samples per optimizer update
    c.estimated_chunks_per_traj = 0  # 0 = automatic (from env limits, corrected as observed)
    # lengths and batching
    c.max_input_length = 1024  # prompt tokens per turn
    c.sequence_length = 2048  # a sample's total tokens (truncation)
    c.micro_batch_max_tokens = 4096  # tokens per packed micro-batch row
    # loss tokens per row, the positions the LM head runs at (0 = automatic: a quarter of
    # the row, at least a sample's generation budget; see loss_slots in run_config)
    c.micro_batch_max_loss_tokens = 0
    # row lengths a mini-batch may be packed at: micro_batch_max_tokens / ratio^i, i < this
    # (the one computing the fewest slots; each a compiled shape); 1 = always the full row
    c.row_len_buckets = 1
    c.row_len_ratio = 2.0
    # a group of rows whose real tokens end early is computed on the shortest of
    # row / 2^k (k <= this; multiples of 128, >= 512) that holds them: one compiled
    # branch each (accumulation.on_shortest_prefix); 0 = always the whole row
    c.row_prefixes = 2
    # each sample starts at a multiple of this in its row (0 = automatic: the attention
    # block, 128, in bf16 where the learner's attention is block-sparse (CPU), so the
    # sampler's logprobs are the learner's to the last bit in attention; else 1)
    c.sample_align = 0
    # a sample that would straddle one more 128-token attention block than it needs starts
    # on the next block edge when the row's slack allows it without a computed slot more:
    # the same rows, fewer attention block pairs (data.buckets.row_starts)
    c.align_when_free = True
    # Tree packing: a group's common prompt is computed once per row and its members'
    # continuations attend to it (data/tree_packing.py); implies group_minibatches.
    c.share_group_prefix = False
    # Mini-batches take whole groups (samples with one prompt), shuffled as groups, instead
    # of single samples: the split tree packing needs, without tree packing.
    c.group_minibatches = False
    # Micro-batch counts are rounded up to a multiple of this (0 = next power of two): a
    # handful of compiled shapes, without doubling the rows as powers of two can.
    c.rows_bucket = 4
    # Pack every mini-batch to mini_batch_size rows (the most it can need); padding rows are
    # skipped in the scan. Shapes no longer follow episode lengths: no recompilation.
    c.fixed_rows = True
    # generation
    c.system_prompt = ""  # "" = none; else the chat's first (system) message
    # Text put at the start of every reply as context (e.g. "<answer>"): the model generates
    # only what follows, and the environment parses prefix + reply (rollout/conversation.py).
    c.reply_prefix = ""
    c.reply_suffix = ""  # appended to the reply text for the parser only (not in the stream)
    c.generation = ml_collections.ConfigDict(dict(
        temperature=1.0, top_p=1.0, top_k=0, num_return_sequences=1,
        # token ids that end a reply besides EOS (the code then closes it with EOS, mask 0)
        stop_token_ids=(),
    ))
    # environments
    c.custom_envs = ml_collections.ConfigDict({"frozen_lake": env_spec("frozen_lake")})
    # "" = each tag's own env_type; else the one environment all tags play, e.g.
    # `--config.env_id=textarena:GuessTheNumber-v0` (one override picks another game)
    c.env_id = ""
    # Per tag, the settings a recipe tuned for its own environment and their values on any
    # other (`env_specific_settings(c, tag, {...})`, env_specific.py): filled by recipes only
    c.env_specific = ml_collections.ConfigDict()
    c.train_env_manager = env_manager(8, 8)
    c.val_env_manager = env_manager(16, 1)
    # format warm-up: supervised replies with random valid actions, before RL (0 steps = off)
    # lr_schedule: "constant", or "cosine" (learning_rate down to a tenth of it); replies: the
    # replies to draw from at random instead of the environment's own policy (() = its own)
    c.format_warmup = ml_collections.ConfigDict(dict(
        steps=0, learning_rate=2e-3, episodes_per_step=16, max_turns=2, lr_schedule="constant",
        replies=(),
    ))
    # distribution and debugging
    # mesh.context: devices each packed row's positions are split over (docs/configuration.md)
    # mesh.sampler_devices: 0 = the sampler shares the learner's devices and params;
    # k > 0 = each process's last k devices sample, with params resharded after updates.
    # mesh.cpu_devices: JAX devices this process' CPU is split into (1 = one; 0 = one per
    # core, the rows split over them: faster for small models, params copied per device).
    c.mesh = ml_collections.ConfigDict(dict(data=-1, fsdp=1, tensor=1, context=1,
                                            sampler_devices=0, cpu_devices=1))
    # several processes (one per host): jax.distributed; ""/0/-1 = JAX auto-detects
    c.distributed = ml_collections.ConfigDict(dict(
        enabled=False, coordinator_address="", num_processes=0, process_id=-1,
    ))
    c.debug = ml_collections.ConfigDict(dict(dump_dir=""))
    return c


def _fail(field: str, message: str):
    raise ConfigError(f"config.{field}: {message}")


def fail_unknown_field(field: str, allowed, extra: str = "") -> None:
    """The one line for a field the config does not have: the closest name, then all."""
    allowed = sorted(allowed)
    close = difflib.get_close_matches(field.rsplit(".", 1)[-1], allowed, n=1)
    hint = f"did you mean {close[0]!r}? " if close else ""
    _fail(field, f"unknown field; {hint}allowed: {', '.join(allowed)}{extra}")


def _choice(c, field: str, allowed) -> None:
    value = c[field] if "." not in field else _get(c, field)
    if value not in allowed:
        _fail(field, f"{value!r} is not allowed; choose one of {', '.join(map(str, allowed))}")


def _get(c, dotted: str):
    for part in dotted.split("."):
        c = c[part]
    return c


def _positive(c, field: str, allow_zero: bool = False) -> None:
    value = _get(c, field)
    if isinstance(value, bool) or not isinstance(value, int | float):
        _fail(field, f"must be a number, got {type(value).__name__}")
    if value < 0 or (value == 0 and not allow_zero):
        _fail(field, f"must be {'>= 0' if allow_zero else '> 0'}, got {value}")


def declared_backend_or_none(env_type: str) -> str | None:
    from jaxrl_agentic.envs.registry import declared_backend

    try:
        return declared_backend(env_type)
    except ValueError:
        return None


def validate(c) -> None:
    """Raises ConfigError (one line) for the first value that cannot work."""
    defaults = default_config()
    unknown = set(c.keys()) - set(defaults.keys())
    if unknown:
        field = sorted(unknown)[0]
        fail_unknown_field(field, defaults.keys())
    for field in ("generation", "mesh", "debug", "format_warmup", "distributed", "teacher"):
        extra = set(c[field].keys()) - set(defaults[field].keys())
        if extra:
            fail_unknown_field(f"{field}.{sorted(extra)[0]}", defaults[field].keys())
    try:  # another environment than the recipe's own leaves the settings tuned for it
        c = resolve_env_specific(c)
    except (TypeError, ValueError) as e:
        _fail("env_specific", str(e))
    _choice(c, "adv_estimator", estimator_names())
    _choice(c, "sample_mode", SAMPLE_MODES)
    _choice(c, "lr_scheduler_type", LR_SCHEDULER_TYPES)
    _choice(c, "reward_norm_by", REWARD_NORM_BY)
    _choice(c, "dtype", DTYPES)
    for field in ("sample_align", "row_prefixes", "eval_transcripts", "save_total_limit"):
        _positive(c, field, allow_zero=True)
    _choice(c, "param_dtype", DTYPES)
    for field in ("untie_word_embeddings", "align_when_free", "share_group_prefix",
                  "group_minibatches", "lora_train_embedding"):
        if not isinstance(c[field], bool):
            _fail(field, f"must be True or False, got {c[field]!r}")
    for field in ("max_steps", "ppo_epochs", "mini_batch_size", "max_input_length",
                  "sequence_length", "micro_batch_max_tokens", "learning_rate",
                  "generation.temperature", "save_steps", "logging_steps", "eval_steps"):
        _positive(c, field)
    _positive(c, "micro_batch_max_loss_tokens", allow_zero=True)
    _positive(c, "loraplus_lr_ratio")
    for field, on, what in (("loraplus_lr_ratio", c.loraplus_lr_ratio != 1.0,
                             "scales the LoRA B adapters' LR"),
                            ("lora_train_embedding", c.lora_train_embedding,
                             "trains the embedding beside LoRA adapters")):
        if on and not c.lora_rank:
            _fail(field, f"{what}: set lora_rank too")
    _positive(c, "row_len_buckets")
    for field in ("pg_clip", "init_kl_coef", "target_kl", "entropy_loss_coef", "advantage_clip",
                  "warmup_steps", "weight_decay", "estimated_chunks_per_traj", "head_learning_rate",
                  "gamma", "lambd", "step_reward_gamma", "generation.top_k", "pg_clip_high",
                  "critic_learning_rate", "value_clip", "rows_bucket", "format_warmup.steps",
                  "eval_temperature"):
        _positive(c, field, allow_zero=True)
    _positive(c, "format_warmup.learning_rate")
    _positive(c, "format_warmup.episodes_per_step")
    _positive(c, "format_warmup.max_turns")
    _choice(c, "format_warmup.lr_schedule", WARMUP_LR_SCHEDULES)
    replies = c.format_warmup.replies
    if isinstance(replies, str) or not all(isinstance(r, str) and r for r in replies):
        _fail("format_warmup.replies", f"must be a list of non-empty reply strings, got "
                                       f"{replies!r}")
    if not isinstance(c.generation.num_return_sequences, int) or \
            c.generation.num_return_sequences < 1:
        _fail("generation.num_return_sequences", "must be an integer >= 1")
    if not 0 < c.generation.top_p <= 1:
        _fail("generation.top_p", f"must be in (0, 1], got {c.generation.top_p}")
    if not all(isinstance(i, int) and i >= 0 for i in c.generation.stop_token_ids):
        _fail("generation.stop_token_ids", f"must be token ids (ints >= 0), got "
              f"{c.generation.stop_token_ids!r}")
    if not 0 <= c.min_lr_ratio <= 1:
        _fail("min_lr_ratio", f"must be in [0, 1], got {c.min_lr_ratio}")
    if c.merge_stepwise and c.sample_mode != "step":
        _fail("merge_stepwise", "applies to sample_mode='step' only")
    for name in ("train_env_manager", "val_env_manager"):
        for tag in c[name].tags:
            if tag not in c.custom_envs:
                _fail(f"{name}.tags", f"{tag!r} is not in custom_envs "
                      f"({', '.join(c.custom_envs.keys())})")
    from jaxrl_agentic.run_config import check_typed_configs

    check_typed_configs(c, _fail)
    group = c.train_env_manager.group_size * c.generation.num_return_sequences
    try:  # the estimator's own rules (algos/estimators.py), reported on the run's fields
        validate_estimator(c.adv_estimator, c.sample_mode, group)
    except ValueError as e:
        field = "train_env_manager.group_size" if "group_size" in str(e) else "adv_estimator"
        _fail(field, str(e))
    played = sorted({spec.env_type for spec in c.custom_envs.values()})
    if c.env_id and len(played) != 1:  # one game in several seatings is one environment
        _fail("env_id", f"replaces the environment its tags all play; custom_envs plays {played}")
    for tag, spec in c.custom_envs.items():
        if c.env_id:
            spec = ml_collections.ConfigDict({**spec.to_dict(), "env_type": c.env_id})
        for field in ("max_turns", "max_tokens_per_step"):
            if not isinstance(spec[field], int) or spec[field] < 1:
                _fail(f"custom_envs.{tag}.{field}", f"must be an integer >= 1, got {spec[field]!r}")
        # A turn's prompt is at most max_input_length (the episode ends before a longer
        # one) and its reply at most max_tokens_per_step, so this bounds a step sample and,
        # since a trajectory is its last turn's prompt plus reply, a trajectory sample too.
        if c.max_input_length + spec.max_tokens_per_step > c.sequence_length:
            _fail("sequence_length", f"{c.sequence_length} < max_input_length + "
                  f"max_tokens_per_step of {tag} = "
                  f"{c.max_input_length + spec.max_tokens_per_step}: {c.sample_mode} samples "
                  "would be cut")
        from jaxrl_agentic.envs.registry import (
            registered_envs,
            registered_prefix,
            resolve_backend,
        )

        backend = spec.get("env_backend", "auto")
        if backend not in ENV_BACKENDS:
            _fail(f"custom_envs.{tag}.env_backend", f"{backend!r} is not allowed; "
                  f"allowed: {', '.join(ENV_BACKENDS)}")
        known = registered_envs()
        if spec.env_type not in known and not spec.env_type.startswith("gymnax:") and \
                registered_prefix(spec.env_type) is None:
            _fail(f"custom_envs.{tag}.env_type", f"unknown environment {spec.env_type!r}; "
                  f"registered: {', '.join(known)} or gymnax:<id>")
        try:
            resolve_backend(spec.env_type, backend)
        except ValueError as e:
            _fail(f"custom_envs.{tag}.env_backend", str(e))
        if declared_backend_or_none(spec.env_type) == "jax":
            from jaxrl_agentic.envs.registry import make

            env_config = dict(spec.get("env_config", {}))
            if backend == "python":  # the adapter's own (`python_env.jax_env_factory`)
                for key in ("step_delay_s", "hang_on_step"):
                    env_config.pop(key, None)
            try:  # the params a JAX environment takes (`env_id` may name another one)
                make(spec.env_type, **env_config)
            except (ValueError, TypeError) as e:
                _fail(f"custom_envs.{tag}.env_config", str(e))
        if registered_prefix(spec.env_type) is not None:
            # Another library's id (`textarena:<id>`): its builder knows whether the id
            # exists and whether the library is installed; a config error, not a crash.
            from jaxrl_agentic.envs.python_env import make_python_env

            try:
                make_python_env(spec.env_type, format_penalty=spec.format_penalty,
                                **dict(spec.get("env_config", {})))
            except (ValueError, ImportError, TypeError) as e:
                _fail(f"custom_envs.{tag}.env_type", str(e))
        if spec.get("step_timeout_s", 0.0) < 0 or spec.get("env_max_workers", 0) < 0:
            _fail(f"custom_envs.{tag}", "step_timeout_s and env_max_workers must be >= 0")
    _positive(c, "async_generation_ratio", allow_zero=True)
    if not isinstance(c.max_policy_lag, int) or isinstance(c.max_policy_lag, bool) \
            or c.max_policy_lag < 0:
        _fail("max_policy_lag", f"must be an integer >= 0, got {c.max_policy_lag!r}")
    if not isinstance(c.in_flight_updates, bool):
        _fail("in_flight_updates", f"must be True or False, got {c.in_flight_updates!r}")
    if c.in_flight_updates and c.async_generation_ratio:
        _fail("in_flight_updates", "bounds the policy lag by max_policy_lag; leave "
              "async_generation_ratio at 0")
    _choice(c, "rollout_batching", ROLLOUT_BATCHING)
    from jaxrl_agentic.sampling.backends import sampler_backend_names

    _choice(c, "sampler_backend", sampler_backend_names())
    for field, least in (("rollout_slots", 0), ("decode_chunk_tokens", 1)):
        if not isinstance(c[field], int) or c[field] < least:
            _fail(field, f"must be an integer >= {least}, got {c[field]!r}")
    if not isinstance(c.rollout_precompile, bool):
        _fail("rollout_precompile", f"must be True or False, got {c.rollout_precompile!r}")
    if not isinstance(c.async_generation_ratio, int):
        _fail("async_generation_ratio", f"must be an integer, got {c.async_generation_ratio!r}")
    _positive(c, "tis_imp_ratio_cap", allow_zero=True)
    validate_filters(c)
    if c.pretrain not in ("tiny", "tiny-tools"):
        from jaxrl_agentic.models.packaged import packaged_model_names
        from jaxrl_agentic.models.sources import source_problem

        problem = source_problem(c.pretrain)
        if problem:
            names = ", ".join(("tiny", "tiny-tools", *packaged_model_names()))
            _fail("pretrain", f"{problem} (a Hugging Face directory, a .gguf file, or one "
                  f"of {names})")
    if c.teacher.pretrain:
        from jaxrl_agentic.run_paths import teacher_source_problem

        if problem := teacher_source_problem(c.teacher.pretrain):
            _fail("teacher.pretrain", problem)
    if c.mesh.data == 0 or c.mesh.fsdp == 0 or c.mesh.tensor == 0:
        _fail("mesh", "axis sizes must be >= 1, or -1 to fill the remaining devices")
    _positive(c, "mesh.sampler_devices", allow_zero=True)
    validate_devices(c)
    validate_distributed(c)


def validate_devices(c) -> None:
    """`mesh.cpu_devices` alone: checked before it is applied, which must happen before
    anything touches the JAX backend (`parallel.use_cpu_devices`)."""
    count = c.mesh.get("cpu_devices", 1)
    if not isinstance(count, int) or isinstance(count, bool) or count < 0:
        _fail("mesh.cpu_devices", f"must be an integer >= 0 (0 = one per core), got {count!r}")


def validate_filters(c) -> None:
    """DAPO's dynamic sampling and overlong handling against the rest of the config."""
    for field in ("dynamic_sampling", "overlong_filter", "logprob_under_sampling_filter"):
        if not isinstance(c[field], bool):
            _fail(field, f"must be True or False, got {c[field]!r}")
    if not isinstance(c.dynamic_sampling_max_rounds, int) or c.dynamic_sampling_max_rounds < 1:
        _fail("dynamic_sampling_max_rounds", f"must be an integer >= 1, got "
              f"{c.dynamic_sampling_max_rounds!r}")
    if c.dynamic_sampling:
        if c.train_env_manager.group_size * c.generation.num_return_sequences < 2:
            _fail("dynamic_sampling", "a group of one has no reward variance; needs "
                  "train_env_manager.group_size >= 2")
        if c.async_generation_ratio or c.in_flight_updates:
            _fail("dynamic_sampling", "extra rounds are played with the current params and "
                  "take the seeds the rollout threads play ahead; use async_generation_ratio=0"
                  " and in_flight_updates=False")
    _positive(c, "overlong_penalty", allow_zero=True)
    _positive(c, "overlong_penalty_length", allow_zero=True)
    if not isinstance(c.overlong_penalty_length, int):
        _fail("overlong_penalty_length", f"must be an integer, got {c.overlong_penalty_length!r}")
    budget = min(spec.max_tokens_per_step for spec in c.custom_envs.values())
    if c.overlong_penalty_length > budget:
        _fail("overlong_penalty_length", f"{c.overlong_penalty_length} > the smallest "
              f"max_tokens_per_step of custom_envs ({budget}): the window lies in the budget")
    if not isinstance(c.loss_norm_length, int) or c.loss_norm_length < 0:
        _fail("loss_norm_length", f"must be an integer >= 0 (0 = the generation budget), got "
              f"{c.loss_norm_length!r}")


def validate_distributed(c) -> None:
    """The `distributed` fields alone: checked before jax.distributed starts (which must
    happen before the rest of validation imports the environments)."""
    d = c.distributed
    address = d.coordinator_address
    if address and (":" not in address or not address.rsplit(":", 1)[1].isdigit()):
        _fail("distributed.coordinator_address", f"expected 'host:port', got {address!r}")
    if d.num_processes < 0:
        _fail("distributed.num_processes", f"must be >= 0 (0 = auto-detect), got "
              f"{d.num_processes}")
    if d.process_id < -1 or (d.num_processes and d.process_id >= d.num_processes):
        _fail("distributed.process_id", f"must be -1 (auto-detect) or in [0, "
              f"num_processes={d.num_processes}), got {d.process_id}")
    if (d.num_processes > 0) != (d.process_id >= 0):
        _fail("distributed", "set num_processes and process_id together (or neither, to "
              "auto-detect)")
    if not d.enabled and (address or d.num_processes):
        _fail("distributed.enabled", "coordinator_address/num_processes are set but "
              "distributed.enabled is False")
