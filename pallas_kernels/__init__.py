"""Fused lm-head logprob and masked PPO loss kernels (Pallas), with plain-JAX references.

Imports only jax and numpy. See docs/kernels.md for formulas, dispatch and tolerances.

The public names are those below and the modules without an underscore
(``segment_attention``, ``token_logprobs``, ``restricted_logprobs``, ``ppo_loss``,
``mesh_axes``); the modules with one are the kernels' own. Besides the kernels, this
exports what the model, the sampler and the learner share with them: ``online_softmax``
(the one attention update both sides run), the same-bits switches (``keeps_same_bits``,
``fixed_order_sum``, ``compiler_options``), ``use_mesh_for_kernels`` (how a traced step
tells the kernels its mesh) and ``matmul_precision``; and, for benchmarks and device
checks, ``DKDV_GRIDS`` (``segment_attention``'s ``dkdv_grid`` choices) and
``cudnn_packed_attention`` (cuDNN's packed attention alone).
"""

from pallas_kernels import _online_softmax as online_softmax
from pallas_kernels._cudnn_attention import cudnn_packed_attention
from pallas_kernels._flash_attention_pallas import DKDV_GRIDS
from pallas_kernels._per_shard import use_mesh_for_kernels
from pallas_kernels._same_bits import compiler_options, fixed_order_sum, keeps_same_bits
from pallas_kernels._softmax_math import matmul_precision
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
    "DKDV_GRIDS",
    "OUT_OF_SUPPORT_LOGPROB",
    "LogprobBlocks",
    "PPOLossSums",
    "SURROGATES",
    "choose_blocks",
    "compiler_options",
    "cudnn_packed_attention",
    "fixed_order_sum",
    "keeps_same_bits",
    "masked_ppo_loss",
    "matmul_precision",
    "online_softmax",
    "pallas_token_logprobs",
    "reference_ppo_loss",
    "reference_token_logprobs",
    "resolve_impl",
    "restricted_token_logprobs",
    "support_mask",
    "token_logprobs",
    "use_mesh_for_kernels",
]
