"""bf16 compute rounds only the matmuls' inputs: the residual stream and every projection's
output stay float32 (models/transformer.py). A bf16 residual or bf16 projection outputs made
the sampler's decode and the learner's packed forward drift apart layer after layer: at the
Qwen2.5-0.5B shape the mean logprob gap went 8.3e-3 → 3.0e-3 with this contract
(docs/notes/bf16_agreement.md); this test holds the contract itself, which a small model's
gap is too noisy to show."""

import jax.numpy as jnp
import numpy as np
from flax import nnx

from jaxrl_agentic.models.config import ModelConfig
from jaxrl_agentic.models.rope import rope_cos_sin
from jaxrl_agentic.models.transformer import PackedRows, Transformer


def _model():
    cfg = ModelConfig(model_type="qwen2", vocab_size=512, hidden_size=64, intermediate_size=128,
                      num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                      head_dim=16, attention_bias=True, tie_word_embeddings=True,
                      dtype="bfloat16", param_dtype="float32")
    return Transformer(cfg, rngs=nnx.Rngs(0))


def test_bf16_compute_keeps_the_residual_stream_and_projection_outputs_in_float32():
    m = _model()
    tokens = jnp.arange(12)[None] % 512
    positions = jnp.arange(12)[None]
    x = m.residual_input(tokens)
    assert x.dtype == jnp.float32
    # h_0 holds the embeddings as the matmuls see them (rounded to bf16), widened.
    np.testing.assert_array_equal(np.asarray(x), np.asarray(
        m.embed.embedding[...][tokens].astype(jnp.bfloat16).astype(jnp.float32)))
    block = m.layer(0)
    for proj in (block.attn.q_proj, block.attn.o_proj, block.mlp.gate_proj, block.mlp.down_proj):
        assert proj(jnp.ones((1, proj.in_features), jnp.bfloat16)).dtype == jnp.float32
    cos, sin = rope_cos_sin(positions, m._inv_freq, m._rope_scale)
    out, (k, v) = block(x, cos, sin, PackedRows(jnp.ones((1, 12), jnp.int32)))
    assert out.dtype == jnp.float32
    # Attention and the KV cache stay in the compute dtype, the same on both paths.
    assert k.dtype == v.dtype == jnp.bfloat16
    # A block's residual output differs from its input by float32 sums, not bf16 ones:
    # the increment is not representable in bf16 everywhere.
    assert np.any(np.asarray(out) != np.asarray(out.astype(jnp.bfloat16).astype(jnp.float32)))

