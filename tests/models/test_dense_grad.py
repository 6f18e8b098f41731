"""`projection_dot_general`: the projections' gradients on CPU, computed as Xᵀ·dY, against the
gradients written out in float64 numpy (dx = dy·Wᵀ, dW = Σ_t x_tᵀ dy_t, db = Σ_t dy_t), and the
dispatch: CPU takes the custom weight gradient, other backends plain `lax.dot_general`."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from jaxrl_agentic.models import dense_grad
from jaxrl_agentic.models.dense_grad import projection_dot_general


def _linear(n_in, n_out, dtype, bias=True):
    return nnx.Linear(n_in, n_out, use_bias=bias, dtype=dtype, param_dtype=jnp.float32,
                      preferred_element_type=jnp.float32, dot_general=projection_dot_general,
                      bias_init=nnx.initializers.normal(0.5), rngs=nnx.Rngs(0))


def _grads(layer, x, g):
    """Gradients of Σ g·layer(x) w.r.t. x and the layer's parameters."""
    graphdef, params = nnx.split(layer)

    def objective(params, x):
        return jnp.sum(g * nnx.merge(graphdef, params)(x))

    return jax.grad(objective, argnums=(0, 1))(params, x)


@pytest.mark.parametrize("shape", [(2, 37, 24), (1, 64, 24), (5, 24)])
def test_gradients_match_the_formulas_in_float64(shape):
    n_in, n_out = shape[-1], 40
    rng = np.random.default_rng(0)
    x = jnp.asarray(rng.normal(size=shape), jnp.float32)
    g = jnp.asarray(rng.normal(size=shape[:-1] + (n_out,)), jnp.float32)
    layer = _linear(n_in, n_out, jnp.float32)
    d_params, dx = _grads(layer, x, g)

    w = np.asarray(layer.kernel[...], np.float64)
    x64, g64 = np.asarray(x, np.float64), np.asarray(g, np.float64)
    np.testing.assert_allclose(dx, g64 @ w.T, rtol=1e-5, atol=1e-5)
    np.testing.assert_allclose(d_params["kernel"][...],
                               x64.reshape(-1, n_in).T @ g64.reshape(-1, n_out),
                               rtol=1e-5, atol=1e-4)
    np.testing.assert_allclose(d_params["bias"][...], g64.reshape(-1, n_out).sum(0),
                               rtol=1e-5, atol=1e-4)


def test_bf16_compute_matches_autodiff_of_the_plain_dot():
    """bf16 inputs, float32 parameters and accumulation (the learner's bf16 setting): the
    same gradients as autodiff of `lax.dot_general`, to bf16 rounding of the inputs."""
    rng = np.random.default_rng(1)
    x = jnp.asarray(rng.normal(size=(2, 48, 32)), jnp.bfloat16)
    g = jnp.asarray(rng.normal(size=(2, 48, 16)), jnp.float32)
    ours = _linear(32, 16, jnp.bfloat16)
    plain = nnx.Linear(32, 16, dtype=jnp.bfloat16, param_dtype=jnp.float32,
                       preferred_element_type=jnp.float32,
                       bias_init=nnx.initializers.normal(0.5), rngs=nnx.Rngs(0))
    (p_ours, dx_ours), (p_plain, dx_plain) = _grads(ours, x, g), _grads(plain, x, g)
    assert dx_ours.dtype == dx_plain.dtype == jnp.bfloat16
    assert p_ours["kernel"][...].dtype == jnp.float32
    np.testing.assert_allclose(np.asarray(dx_ours, np.float32), np.asarray(dx_plain, np.float32),
                               rtol=1e-2, atol=1e-2)
    np.testing.assert_allclose(p_ours["kernel"][...], p_plain["kernel"][...], rtol=1e-5,
                               atol=1e-4)


def _primitives(fn, *args):
    return {eqn.primitive.name for eqn in jax.make_jaxpr(fn)(*args).eqns}


def test_cpu_takes_the_custom_weight_gradient_other_backends_the_plain_dot(monkeypatch):
    x, w = jnp.ones((3, 8, 4)), jnp.ones((4, 6))
    dims = (((2,), (0,)), ((), ()))
    assert "custom_vjp_call" in _primitives(lambda x, w: projection_dot_general(x, w, dims), x, w)
    # Not a projection's dimension numbers: the plain product, even on CPU.
    batched = (((2,), (1,)), ((0,), (0,)))
    assert _primitives(lambda a, b: projection_dot_general(a, b, batched),
                       x, jnp.ones((3, 4, 5))) == {"dot_general"}
    monkeypatch.setattr(dense_grad.jax, "default_backend", lambda: "gpu")
    assert _primitives(lambda x, w: projection_dot_general(x, w, dims), x, w) == {"dot_general"}


def test_remat_dots_policy_still_keeps_the_projection_outputs(capsys):
    """`remat="dots"` saves the projections' outputs (`REMAT_POLICIES`): the custom weight
    gradient must not hide them from the policy, or "dots" would recompute every matmul."""
    dims = (((2,), (0,)), ((), ()))

    def two_projections(x, w1, w2):
        h = projection_dot_general(x, w1, dims)
        return jnp.sum(projection_dot_general(jnp.tanh(h), w2, dims))

    policy = jax.checkpoint_policies.dots_with_no_batch_dims_saveable
    jax.ad_checkpoint.print_saved_residuals(jax.checkpoint(two_projections, policy=policy),
                                           jnp.ones((1, 8, 4)), jnp.ones((4, 6)),
                                           jnp.ones((6, 3)))
    saved = capsys.readouterr().out.splitlines()
    assert any(line.startswith("f32[1,8,6] output of dot_general") for line in saved), saved
