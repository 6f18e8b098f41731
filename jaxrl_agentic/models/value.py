"""Critic for GAE: a decoder backbone with a scalar value head.

    V(prefix) = w · RMSNorm(h_t) + b,    h_t = the backbone's hidden state at the last token

`values(tokens, positions, segment_ids)[b, t]` is the value of the state *after reading*
token t, i.e. the value before token t+1 is generated. The value that belongs to a
generated token k (the state it was chosen in) is therefore `values[k − 1]`: the same shift
as logprobs, where token k's logprob comes from hidden state k − 1. `state_values` applies
that shift so estimators index by the token itself.
"""

from __future__ import annotations

import jax.numpy as jnp
from flax import nnx

from jaxrl_agentic.models.config import ModelConfig
from jaxrl_agentic.models.transformer import Transformer


class ValueModel(nnx.Module):
    def __init__(self, cfg: ModelConfig, *, rngs: nnx.Rngs, backbone: Transformer | None = None):
        # Usually initialised from the policy's weights (pass `backbone`), as PPO critics are.
        self.backbone = backbone if backbone is not None else Transformer(cfg, rngs=rngs)
        # Zero-initialised head: the critic starts predicting 0 rather than noise.
        self.head = nnx.Linear(cfg.hidden_size, 1, kernel_init=nnx.initializers.zeros,
                               rngs=rngs)

    def values(self, tokens, positions, segment_ids=None, prefix_ids=None) -> jnp.ndarray:
        """[B, T] float32: value after reading each token (see module doc)."""
        hidden = self.backbone.hidden_states(tokens, positions, segment_ids,
                                             prefix_ids=prefix_ids)
        return self.head(hidden.astype(jnp.float32))[..., 0]


def state_values(values_after: jnp.ndarray) -> jnp.ndarray:
    """[B, T] value of the state each token was generated in: V_k = values_after[k − 1].

    Position 0 has no preceding state inside the row and gets 0 (it is never a generated
    token: every sample starts with a prompt).
    """
    return jnp.pad(values_after[..., :-1], [(0, 0)] * (values_after.ndim - 1) + [(1, 0)])
