import jax
import jax.numpy as jnp
import numpy as np
import pytest
from gymnax.environments.bsuite import catch

from jaxrl_agentic.envs import INVALID_ACTION, GymnaxTextState, make


@pytest.fixture(scope="module")
def catch_env():
    return make("gymnax:Catch-bsuite")


def catch_state(env, ball_x, ball_y, paddle_x, time=0):
    inner = catch.EnvState(
        ball_x=jnp.int32(ball_x), ball_y=jnp.int32(ball_y), paddle_x=jnp.int32(paddle_x),
        paddle_y=jnp.int32(9), prev_done=jnp.bool_(False), time=jnp.int32(time),
    )
    return GymnaxTextState(inner=inner, obs=env.inner.get_obs(inner), time=jnp.int32(time))


def test_catch_render_text_rgb_and_hash(catch_env):
    env, params = catch_env
    assert env.action_names == ("Left", "Stay", "Right")
    state = catch_state(env, ball_x=1, ball_y=0, paddle_x=2)
    rows = ["0 1 0 0 0"] + ["0 0 0 0 0"] * 8 + ["0 0 1 0 0"]
    assert env.render_text(state, params) == "Observation (shape (10, 5)):\n" + "\n".join(rows)
    image = env.render_rgb(state, params)
    assert image.dtype == np.uint8 and image.shape == (80, 40, 3)
    assert tuple(image[4, 12]) == (255, 255, 255) and tuple(image[4, 4]) == (0, 0, 0)
    assert tuple(image[76, 20]) == (255, 255, 255)
    same_later = catch_state(env, ball_x=1, ball_y=0, paddle_x=2, time=5)
    assert env.state_hash(same_later) == env.state_hash(state)
    assert env.state_hash(catch_state(env, ball_x=3, ball_y=0, paddle_x=2)) != env.state_hash(state)


def test_number_formatting_rounds_and_shows_the_shape():
    env, params = make("gymnax:CartPole-v1")
    obs = jnp.array([0.1234, -1.0, 0.0071, 2.0], jnp.float32)
    _, state = env.reset(jax.random.key(0), params)
    state = state.replace(obs=obs)
    assert env.render_text(state, params) == "Observation (shape (4,)):\n0.12 -1 0.01 2"


def play_catch(env, params, choose, key, invalid_every=0):
    """Step one Catch episode to its end with `choose(state) -> action`; returns the steps."""
    step = jax.jit(env.step)
    key, reset_key = jax.random.split(key)
    _, state = env.reset(reset_key, params)
    steps = []
    while True:
        key, step_key = jax.random.split(key)
        invalid = invalid_every and len(steps) % invalid_every == invalid_every - 1
        action = INVALID_ACTION if invalid else choose(state)
        before = state
        obs, state, reward, term, trunc, info = step(step_key, state, action, params)
        steps.append((before, action, obs, state, float(reward), bool(term), bool(trunc), info))
        if bool(term) or bool(trunc):
            return steps


def steer(state):
    ball, paddle = int(state.inner.ball_x), int(state.inner.paddle_x)
    return 0 if paddle > ball else 2 if paddle < ball else 1


def test_catch_episode_rewards_invalid_actions_and_auto_reset(catch_env):
    env, params = catch_env
    steps = play_catch(env, params, steer, jax.random.key(0), invalid_every=3)
    rewards = [s[4] for s in steps]
    valid = [s[1] != INVALID_ACTION for s in steps]
    assert sum(valid) == 9  # the ball falls one row per valid step, 9 rows to the paddle
    for before, action, _, after, reward, term, _, info in steps[:-1]:
        assert bool(info["action_is_valid"]) == (action != INVALID_ACTION)
        if action == INVALID_ACTION:
            assert reward == pytest.approx(-0.1) and not term
            assert env.state_hash(after) == env.state_hash(before)
            assert int(after.time) == int(before.time) + 1
            assert not bool(info["action_is_effective"])
        else:
            assert reward == 0.0 and bool(info["action_is_effective"])
    before, _, obs, after, reward, term, trunc, info = steps[-1]
    assert reward == 1.0 and term and not trunc and bool(info["success"])
    final = np.asarray(info["final_observation"])
    assert final[9].sum() == 1  # ball caught: ball and paddle share the bottom cell
    assert int(after.time) == 0 and np.asarray(obs)[0].sum() == 1  # auto-reset: new ball on top
    assert sum(r == pytest.approx(-0.1) for r in rewards) == valid.count(False) == 4


def test_catch_missed_ball_is_not_a_success(catch_env):
    env, params = catch_env
    for seed in range(20):  # a start where staying put misses the ball
        key = jax.random.key(seed)
        _, state = env.reset(jax.random.split(key)[1], params)
        if int(state.inner.ball_x) != int(state.inner.paddle_x):
            break
    steps = play_catch(env, params, lambda state: 1, key)
    *_, reward, term, _, info = steps[-1]
    assert len(steps) == 9 and reward == -1.0 and term and not bool(info["success"])


def test_truncation_and_param_overrides_reach_the_wrapped_params():
    env, params = make("gymnax:CartPole-v1", max_steps_in_episode=3, gravity=3.0,
                       format_penalty=0.2)
    assert params.inner.gravity == 3.0 and params.format_penalty == 0.2
    assert env.action_names == ("Left", "Right") and env.parse_action("<answer>RIGHT</answer>") == 1
    _, state = env.reset(jax.random.key(0), params)
    step = jax.jit(env.step)
    for t, action in enumerate([1, INVALID_ACTION, 0]):
        _, state, reward, term, trunc, info = step(jax.random.key(t), state, action, params)
        assert bool(trunc) == (t == 2) and not bool(term)
        assert float(reward) == pytest.approx(-0.2 if action == INVALID_ACTION else 1.0)
        assert bool(info["action_is_effective"]) == (action != INVALID_ACTION)


def test_generic_action_names_and_errors():
    env, _ = make("gymnax:DeepSea-bsuite")
    assert env.action_names == ("0", "1") and env.parse_action("<answer> 1 </answer>") == 1
    with pytest.raises(ValueError, match="Discrete") as error:
        make("gymnax:Pendulum-v1")
    assert "\n" not in str(error.value)
    with pytest.raises(ValueError, match="unknown gymnax environment 'Nope-v0'.*CartPole-v1"):
        make("gymnax:Nope-v0")
    with pytest.raises(ValueError, match="unknown parameter 'wind'.*format_penalty.*gravity"):
        make("gymnax:CartPole-v1", wind=1.0)
    with pytest.raises(ValueError, match="unknown parameter 'inner'"):
        make("gymnax:CartPole-v1", inner=None)
