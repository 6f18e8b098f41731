"""The one place the run's flat ConfigDict becomes the typed configs of the parts.

Each part validates its own rules in its typed config (``ValueError("<field>: <why>")``);
:func:`check_typed_configs` builds them all from a run config so that ``config.validate``
reports those rules as ``config.<field>: <why>`` without a second copy of any rule. The
typed configs' defaults equal ``config.default_config()``'s (a test holds them to it).
"""

from __future__ import annotations

from jaxrl_agentic.algos.estimators import get_advantage_estimator
from jaxrl_agentic.data import PackingConfig
from jaxrl_agentic.rollout.groups import EnvManagerConfig
from jaxrl_agentic.rollout.turns import GenerationConfig
from jaxrl_agentic.training.critic import CriticConfig
from jaxrl_agentic.training.learner_config import LearnerConfig


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


def check_typed_configs(c, fail) -> None:
    """Builds every typed config of run config `c`; the first rule one breaks is reported as
    `fail(run-config field, why)`."""
    builders = [("", lambda: learner_config(c))]
    if get_advantage_estimator(c.adv_estimator).needs_critic:
        builders.append(("", lambda: critic_config(c)))
    for name in ("train_env_manager", "val_env_manager"):
        n = c.generation.num_return_sequences if name == "train_env_manager" else 1
        builders.append((f"{name}.", lambda name=name, n=n: env_manager_config(c[name], n)))
    for prefix, build in builders:
        try:
            build()
        except ValueError as e:
            field, _, why = str(e).partition(": ")
            fail(prefix + field, why)
