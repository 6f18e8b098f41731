"""The decoder blocks stored stacked (`Transformer.layers`: every weight [L, ...]) and the
tied embedding's one-expression gradient (`tied_input_and_head`).

The remat scan used to stack a list of blocks' weights on every step (a copy of the block
weights and one of their gradient: 1.34 GiB at Qwen2.5-0.5B in bf16). Stored stacked, the
scan reads the parameters where they are. What must not change: the initial values, the
forward, which weights get weight decay, and the gradient of a tied embedding.
"""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from jaxrl_agentic.models.config import ModelConfig
from jaxrl_agentic.models.rope import rope_cos_sin
from jaxrl_agentic.models.transformer import (
    _INIT,
    Block,
    PackedRows,
    Transformer,
    tied_input_and_head,
)
from jaxrl_agentic.training.update import _decay_mask

CFG = ModelConfig(vocab_size=96, hidden_size=32, intermediate_size=64, num_hidden_layers=3,
                  num_attention_heads=4, num_key_value_heads=2, head_dim=8)


def test_blocks_start_as_separately_built_blocks():
    """The stacked weights hold what a list of blocks built in the same order holds, so a
    seed gives the same model as before the layout changed."""
    model = Transformer(CFG, rngs=nnx.Rngs(0))
    rngs = nnx.Rngs(0)
    nnx.Embed(CFG.vocab_size, CFG.hidden_size, embedding_init=_INIT, rngs=rngs)
    blocks = [Block(CFG, rngs) for _ in range(CFG.num_hidden_layers)]
    for i, block in enumerate(blocks):
        expected = nnx.to_pure_dict(nnx.state(block, nnx.Param))
        got = nnx.to_pure_dict(nnx.state(model.layer(i), nnx.Param))
        jax.tree.map(np.testing.assert_array_equal, got, expected)
    shapes = nnx.to_pure_dict(nnx.state(model.layers, nnx.Param))
    assert shapes["attn"]["q_proj"]["kernel"].shape == (3, 32, 32)
    assert shapes["input_norm"]["scale"].shape == (3, 32)


@pytest.mark.parametrize("remat", ["none", "layer", "dots"])
def test_forward_equals_the_blocks_run_one_after_another(remat):
    model = Transformer(CFG, rngs=nnx.Rngs(1))
    tokens = jnp.asarray([[5, 9, 2, 77, 31, 4, 8, 1]])
    positions = jnp.asarray([[0, 1, 2, 3, 0, 1, 2, 3]])
    segments = jnp.asarray([[1, 1, 1, 1, 2, 2, 2, 0]])
    x = model.residual_input(tokens)
    cos, sin = rope_cos_sin(positions, model._inv_freq, model._rope_scale)
    for i in range(CFG.num_hidden_layers):
        x = model.layer(i)(x, cos, sin, PackedRows(segments))[0]
    expected = model.final_norm(x)
    got = model.hidden_states(tokens, positions, segments, remat=remat)
    valid = np.asarray(segments[0] > 0)
    np.testing.assert_allclose(np.asarray(got)[0, valid], np.asarray(expected)[0, valid],
                               rtol=1e-5, atol=1e-5)


def test_weight_decay_reaches_matrices_not_stacked_vectors():
    """A bias or norm scale stacked over layers is [L, D]: two dimensions, still a vector
    per layer. A rule on ndim alone would decay it."""
    model = Transformer(CFG, rngs=nnx.Rngs(0))
    mask = nnx.to_pure_dict(_decay_mask(nnx.state(model, nnx.Param)))
    assert mask["embed"]["embedding"]
    assert mask["layers"]["attn"]["q_proj"]["kernel"]
    assert mask["layers"]["mlp"]["down_proj"]["kernel"]
    assert not mask["layers"]["attn"]["q_proj"]["bias"]
    assert not mask["layers"]["input_norm"]["scale"]
    assert not mask["final_norm"]["scale"]


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_tied_gradient_equals_autodiff_of_the_two_uses(dtype):
    """The custom backward gives exactly what autodiff gives for the lookup and the head
    used separately: repeated tokens add up, an out-of-range id adds nothing."""
    emb = jax.random.normal(jax.random.key(0), (CFG.vocab_size, CFG.hidden_size)) * 0.1
    tokens = jnp.asarray([[3, 7, 3, 95], [0, 3, 96 + 5, 12]])
    hidden = jax.random.normal(jax.random.key(1), (8, CFG.hidden_size)).astype(dtype)
    weights = jax.random.normal(jax.random.key(2), (2, 4, CFG.hidden_size))

    def loss(x0, head):
        x0 = jnp.where(jnp.isnan(x0), 0.0, x0)  # the out-of-range id's row
        logits = jnp.dot(hidden, head, preferred_element_type=jnp.float32)
        return jnp.sum(x0 * weights) + jnp.sum(jax.nn.log_softmax(logits)[:, :7])

    def autodiff(e):
        x0 = jnp.take(e, tokens, axis=0).astype(dtype).astype(jnp.float32)
        return loss(x0, e.T.astype(dtype))

    def custom(e):
        return loss(*tied_input_and_head(e, tokens, jnp.dtype(dtype)))

    assert float(custom(emb)) == float(autodiff(emb))
    np.testing.assert_array_equal(np.asarray(jax.jit(jax.grad(custom))(emb)),
                                  np.asarray(jax.jit(jax.grad(autodiff))(emb)))


def test_hidden_and_head_matches_hidden_states_and_the_cast_head():
    cfg = ModelConfig(**{**CFG.__dict__, "dtype": "bfloat16"})
    model = Transformer(cfg, rngs=nnx.Rngs(2))
    tokens = jnp.asarray([[5, 9, 2, 77]])
    positions = jnp.arange(4)[None]
    hidden, head = model.hidden_and_head(tokens, positions, remat="layer")
    np.testing.assert_array_equal(np.asarray(head),
                                  np.asarray(model.lm_head_weight().astype(jnp.bfloat16)))
    np.testing.assert_array_equal(
        np.asarray(hidden), np.asarray(model.hidden_states(tokens, positions, remat="layer")))
