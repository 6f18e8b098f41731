"""The policy learner's settings: its loss, KL, importance-sampling and kernel choices on top
of the optimizer/packing ones every trained model shares (``update.UpdateConfig``)."""

from __future__ import annotations

import dataclasses

from jaxrl_agentic.algos.importance import TIS_LEVELS, TIS_MODES
from jaxrl_agentic.algos.kl import KL_ESTIMATORS
from jaxrl_agentic.algos.losses import KERNEL_IMPLS
from jaxrl_agentic.algos.policy_losses import get_policy_loss, policy_loss_names
from jaxrl_agentic.algos.reductions import REDUCTIONS
from jaxrl_agentic.algos.teacher_divergence import DISTILL_LOSSES
from jaxrl_agentic.models.transformer import REMAT_POLICIES
from jaxrl_agentic.training.update import UpdateConfig, fail_first
from pallas_kernels.segment_attention import IMPLS as ATTENTION_IMPLS


@dataclasses.dataclass(frozen=True)
class LearnerConfig(UpdateConfig):
    """The policy's loss settings, on top of the shared optimizer/packing ones.

    Loss: ``policy_loss`` a registered name (ppo, gspo, cispo, …; ``algos/policy_losses.py``),
    ``pg_clip`` / ``pg_clip_high`` are ε_lo / ε_hi (None = symmetric), ``dual_clip`` the
    dual-clip bound c (None = off, ppo only), ``loss_reduction`` one of ``REDUCTIONS`` with
    ``loss_norm_length`` L for ``seq_mean_token_sum_norm`` (Dr. GRPO). KL:
    ``init_kl_coef`` β₀, ``target_kl`` (None = fixed β, else the adaptive controller with
    ``kl_horizon``), ``kl_estimator`` k1/k2/k3, ``kl_in_reward`` (penalise rewards instead of
    the loss: the loss then carries no KL term, the reported KL is still measured).
    ``temperature``: the sampling temperature the logprobs are taken at.
    ``recompute_old_logprobs``: replace the sampler's logprobs by the learner's at the start
    of each pipeline step. ``tis_imp_ratio_cap`` C (0 = off, needs recompute): importance
    weights of the sampler/learner gap at ``tis_level`` (token, sequence, geometric) in
    ``tis_mode`` (truncate, mask; the mask's band is ``[tis_lower_cap, C]``, None = 1/C),
    ``algos/importance.py``. ``cispo_clip_low`` / ``cispo_clip_high``: CISPO's weight bounds
    ``clip(r, 1 − ε_lo, 1 + ε_hi)`` (ε_lo ≥ 1: no lower bound, as MiniMax-M1), apart from
    PPO's ``pg_clip`` so that each keeps its own range. ``top_k`` / ``top_p``: the
    sampler's support restriction; with ``logprob_under_sampling_filter`` every logprob the
    learner computes is that of the renormalised distribution the sampler drew from
    (``pallas_kernels/restricted_logprobs.py``), so the ratio is that of the distribution
    actually sampled. ``kernel_impl``: ``token_logprobs`` implementation.
    ``attention_impl``: the training forward's segment-aware attention
    (``pallas_kernels.segment_attention``). ``remat``: the
    training forward's rematerialisation, one of ``REMAT_POLICIES``
    (``models/transformer.py``; "layer" keeps only the blocks' inputs for the backward).
    ``distill_loss``: "sampled" (no teacher in the loss: its sampled estimator is an
    advantage, ``pipeline/distillation.py``) or one of ``DIVERGENCES``, a distillation
    teacher's whole distribution against the policy's at each loss token, added to the
    objective as ``distill_coef·Σ w_t·D_t`` (``algos/teacher_divergence.py``; the teacher is
    passed to the learner). Defaults equal the run defaults (``config.default_config``).
    """

    policy_loss: str = "ppo"
    loss_reduction: str = "token_mean"
    loss_norm_length: float | None = None
    pg_clip: float = 0.2
    pg_clip_high: float | None = None
    dual_clip: float | None = None
    init_kl_coef: float = 0.0
    target_kl: float | None = None
    kl_horizon: float = 10000.0
    kl_estimator: str = "k3"
    kl_in_reward: bool = False
    entropy_loss_coef: float = 0.0
    temperature: float = 1.0
    recompute_old_logprobs: bool = False
    tis_imp_ratio_cap: float = 0.0
    tis_level: str = "token"
    tis_mode: str = "truncate"
    tis_lower_cap: float | None = None
    cispo_clip_low: float = 1.0
    cispo_clip_high: float = 0.28
    top_k: int = 0
    top_p: float = 1.0
    logprob_under_sampling_filter: bool = False
    kernel_impl: str = "auto"
    attention_impl: str = "auto"
    remat: str = "none"
    distill_loss: str = "sampled"
    distill_coef: float = 1.0

    def __post_init__(self):
        super().__post_init__()
        fail_first([
            (self.policy_loss in policy_loss_names(), "policy_loss",
             f"choose one of {', '.join(policy_loss_names())} (or register one: "
             "algos.policy_losses.register_policy_loss)"),
            (self.distill_loss in DISTILL_LOSSES, "distill_loss",
             f"choose one of {', '.join(DISTILL_LOSSES)}"),
            (self.distill_coef >= 0, "distill_coef", "must be a number >= 0"),
            (self.remat in REMAT_POLICIES, "remat", f"choose one of {', '.join(REMAT_POLICIES)}"),
            (self.loss_reduction in REDUCTIONS, "loss_reduction",
             f"choose one of {', '.join(REDUCTIONS)}"),
            (self.loss_reduction != "seq_mean_token_sum_norm"
             or (self.loss_norm_length or 0) > 0, "loss_norm_length",
             "seq_mean_token_sum_norm divides each sample's token sum by it; set it > 0"),
            (self.dual_clip is None or self.policy_loss not in policy_loss_names()
             or get_policy_loss(self.policy_loss).allows_dual_clip, "dual_clip",
             f"bounds PPO's token loss; policy_loss={self.policy_loss!r} has none"),
            (self.kernel_impl in KERNEL_IMPLS, "kernel_impl",
             f"choose one of {', '.join(KERNEL_IMPLS)}"),
            (self.attention_impl in ATTENTION_IMPLS, "attention_impl",
             f"choose one of {', '.join(ATTENTION_IMPLS)}"),
            (self.kl_estimator in KL_ESTIMATORS, "kl_estimator",
             f"choose one of {', '.join(KL_ESTIMATORS)}"),
            (0 < self.pg_clip < 1, "pg_clip", "must lie in (0, 1)"),
            (self.pg_clip_high is None or self.pg_clip_high > 0, "pg_clip_high", "must be > 0"),
            (self.dual_clip is None or self.dual_clip > 1, "dual_clip", "must be 0 (off) or > 1"),
            (self.init_kl_coef >= 0, "init_kl_coef", "must be >= 0"),
            (self.target_kl is None or (self.target_kl > 0 and self.init_kl_coef > 0),
             "target_kl", "an adaptive KL coefficient needs init_kl_coef > 0 to start from"),
            (self.kl_horizon > 0, "kl_horizon", "must be > 0"),
            (not self.kl_in_reward or self.init_kl_coef > 0, "kl_in_reward",
             "folds init_kl_coef·KL into the rewards; set init_kl_coef > 0"),
            (self.entropy_loss_coef >= 0, "entropy_loss_coef", "must be >= 0"),
            (self.temperature > 0, "temperature", "must be > 0"),
            (self.tis_imp_ratio_cap >= 0, "tis_imp_ratio_cap", "must be >= 0"),
            (self.tis_imp_ratio_cap == 0 or self.recompute_old_logprobs, "tis_imp_ratio_cap",
             "needs recompute_old_logprobs=True (without it the old policy is the behaviour "
             "policy and every weight is 1)"),
            (self.tis_level in TIS_LEVELS, "tis_level", f"choose one of {', '.join(TIS_LEVELS)}"),
            (self.tis_mode in TIS_MODES, "tis_mode", f"choose one of {', '.join(TIS_MODES)}"),
            (self.tis_lower_cap is None or 0 < self.tis_lower_cap <= max(
                self.tis_imp_ratio_cap, 0), "tis_lower_cap",
             "must lie in (0, tis_imp_ratio_cap] (0 = 1/tis_imp_ratio_cap)"),
            (self.cispo_clip_low >= 0, "cispo_clip_low",
             "must be >= 0 (>= 1: no lower bound on the weight)"),
            (self.cispo_clip_high > 0, "cispo_clip_high", "must be > 0"),
            (self.top_k >= 0, "top_k", "must be >= 0 (0 = off)"),
            (0 < self.top_p <= 1, "top_p", "must lie in (0, 1]"),
            (not self.logprob_under_sampling_filter or self.restricts_support,
             "logprob_under_sampling_filter", "needs generation top_k > 0 or top_p < 1"),
        ], self)

    @property
    def ratio_bounds(self) -> tuple[float, float | None]:
        """``(ε_lo, ε_hi)`` of the policy loss: CISPO's own weight bounds, else PPO's clip."""
        if get_policy_loss(self.policy_loss).bounds == "cispo_clip":
            return self.cispo_clip_low, self.cispo_clip_high
        return self.pg_clip, self.pg_clip_high

    @property
    def restricts_support(self) -> bool:
        """Whether the sampler draws from a top-k / top-p restricted support."""
        return self.top_k > 0 or self.top_p < 1.0

    @property
    def logprob_filter(self) -> tuple[int, float]:
        """``(top_k, top_p)`` the learner's logprobs are taken under ((0, 1.0) = none)."""
        if self.logprob_under_sampling_filter:
            return self.top_k, self.top_p
        return 0, 1.0

    @property
    def uses_teacher(self) -> bool:
        """Whether the loss holds a distillation teacher's whole distribution."""
        return self.distill_loss != "sampled"

    @property
    def uses_reference(self) -> bool:
        """A reference policy is kept iff the KL coefficient can be non-zero."""
        return self.init_kl_coef > 0 or self.target_kl is not None
