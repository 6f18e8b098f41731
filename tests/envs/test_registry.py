import pathlib
import re

import jax
import numpy as np
import pytest

from jaxrl_agentic.envs import (
    INVALID_ACTION,
    FrozenLake,
    Sokoban,
    TextEnvironment,
    make,
    register,
    registered_envs,
)

DOCS = pathlib.Path(__file__).resolve().parents[2] / "docs" / "environments.md"


@pytest.fixture(scope="module")
def corridor():
    """Run the worked example of docs/environments.md, which registers "corridor"."""
    text = DOCS.read_text(encoding="utf-8")
    section = text[text.index("## Adding an environment") :]
    code = re.search(r"```python\n(.*?)```", section, re.DOTALL).group(1)
    namespace = {}
    exec(compile(code, str(DOCS), "exec"), namespace)
    return namespace["Corridor"]


def test_make_returns_env_and_params_with_overrides():
    env, params = make("frozen_lake", size=5, format_penalty=0.3)
    assert isinstance(env, FrozenLake) and isinstance(env, TextEnvironment)
    assert (params.size, params.format_penalty, params.p_frozen) == (5, 0.3, 0.8)
    obs, state = env.reset(jax.random.key(0), params)
    assert obs.shape == state.grid.shape == (5, 5)


def test_presets():
    env, params = make("sokoban")
    assert isinstance(env, Sokoban) and (params.dim_room, params.num_boxes) == (6, 1)
    assert params.max_steps_in_episode == 100 and params.format_penalty == 0.1
    _, large = make("sokoban_large")
    _, custom = make("sokoban", dim_room=8, num_boxes=2)
    assert large == custom and (large.dim_room, large.num_boxes) == (8, 2)
    _, state = env.reset(jax.random.key(0), custom)
    assert state.walls.shape == (8, 8) and int(state.boxes.sum()) == 2
    assert make("frozen_lake_slippery")[1].is_slippery
    assert {"frozen_lake", "frozen_lake_slippery", "sokoban", "sokoban_large"} <= set(
        registered_envs()
    )


def test_errors_are_one_line_and_name_the_choices():
    with pytest.raises(ValueError) as error:
        make("frozen_lak")
    message = str(error.value)
    assert "\n" not in message and "'frozen_lak'" in message and "frozen_lake, " in message
    with pytest.raises(ValueError) as error:
        make("sokoban", num_box=2)
    message = str(error.value)
    assert "\n" not in message and "'num_box'" in message
    allowed = "max_steps_in_episode, format_penalty, cell_separator, dim_room, num_boxes"
    assert f"allowed: {allowed}" in message
    with pytest.raises(ValueError, match="size must be >= 2"):
        make("frozen_lake", size=1)
    with pytest.raises(ValueError, match="num_boxes=20 does not fit"):
        make("sokoban", num_boxes=20)
    with pytest.raises(ValueError, match="cell_separator must be a one-line string"):
        make("frozen_lake", cell_separator="\n")
    register("sokoban", Sokoban)  # the same registration again: nothing changes
    with pytest.raises(ValueError, match="already registered"):
        register("sokoban", FrozenLake)
    with pytest.raises(TypeError, match="callable"):
        register("not_callable", 3)


def test_worked_example_from_the_docs(corridor):
    env, params = make("corridor", length=4)
    assert isinstance(env, corridor) and "corridor" in registered_envs()
    _, state = env.reset(jax.random.key(0), params)
    start = int(state.position)
    expected = "".join("P" if i == start else "_" for i in range(3)) + "E"
    assert env.render_text(state, params) == expected
    assert env.render_rgb(state, params).shape == (16, 64, 3)
    step = jax.jit(env.step_env)
    _, same, reward, term, info = step(jax.random.key(1), state, INVALID_ACTION, params)
    assert float(reward) == pytest.approx(-0.1) and not bool(info["action_is_valid"])
    assert env.state_hash(same) == env.state_hash(state)
    rewards = []
    for t in range(3 - start):
        action = env.parse_action("<answer>right</answer>")
        _, state, reward, term, info = step(jax.random.key(t), state, action, params)
        rewards.append(float(reward))
    assert rewards == [0.0] * (2 - start) + [1.0] and bool(term) and bool(info["success"])
    assert env.render_text(state, params) == "___P"
    # Batched, as the rollout uses it.
    keys = jax.random.split(jax.random.key(2), 64)
    obs, states = jax.vmap(env.reset, in_axes=(0, None))(keys, params)
    assert obs.shape == (64, 1, 4) and np.all(np.asarray(states.position) < 3)
