"""Fused lm-head logprob and masked PPO loss kernels (Pallas), with plain-JAX references.

Imports only jax and numpy. See docs/kernels.md for formulas, dispatch and tolerances.
"""

from pallas_kernels.ppo_loss import (
    SURROGATES,
    PPOLossSums,
    masked_ppo_loss,
    reference_ppo_loss,
)
from pallas_kernels.restricted_logprobs import (
    OUT_OF_SUPPORT_LOGPROB,
    restricted_token_logprobs,
    support_mask,
)
from pallas_kernels.token_logprobs import (
    LogprobBlocks,
    choose_blocks,
    pallas_token_logprobs,
    reference_token_logprobs,
    resolve_impl,
    token_logprobs,
)

__all__ = [
    "OUT_OF_SUPPORT_LOGPROB",
    "LogprobBlocks",
    "PPOLossSums",
    "SURROGATES",
    "choose_blocks",
    "masked_ppo_loss",
    "pallas_token_logprobs",
    "reference_ppo_loss",
    "reference_token_logprobs",
    "resolve_impl",
    "restricted_token_logprobs",
    "support_mask",
    "token_logprobs",
]
