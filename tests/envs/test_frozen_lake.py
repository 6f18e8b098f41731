import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxrl_agentic.envs import INVALID_ACTION, FrozenLakeState, make
from tests.envs.solvers import frozen_lake_path

F, H, G = 0, 1, 2  # tile codes of FrozenLakeState.grid
LEFT, DOWN, RIGHT, UP = 0, 1, 2, 3
CHARS = {F: "_", H: "O", G: "G"}


def board_text(grid: np.ndarray, position) -> str:
    """Independent rendering of the documented symbols."""
    rows = []
    for r, row in enumerate(grid):
        line = ""
        for c, tile in enumerate(row):
            if (r, c) == tuple(position):
                line += {F: "P", H: "X", G: "√"}[int(tile)]
            else:
                line += CHARS[int(tile)]
        rows.append(line)
    return "\n".join(rows)


def hand_state(position=(1, 1), time=0):
    # __O_
    # __G_
    # O___
    # ____
    grid = jnp.array([[F, F, H, F], [F, F, G, F], [H, F, F, F], [F, F, F, F]], jnp.int32)
    return FrozenLakeState(grid=grid, position=jnp.array(position, jnp.int32), time=jnp.int32(time))


@pytest.fixture(scope="module")
def env_and_params():
    return make("frozen_lake")


@pytest.fixture(scope="module")
def step_env(env_and_params):
    return jax.jit(env_and_params[0].step_env)


def test_ten_thousand_random_maps_are_all_solvable(env_and_params):
    env, params = env_and_params
    keys = jax.random.split(jax.random.key(0), 10_000)
    obs, states = jax.jit(jax.vmap(env.reset, in_axes=(0, None)))(keys, params)
    grids, positions = np.asarray(states.grid), np.asarray(states.position)
    assert grids.shape == (10_000, 4, 4) and obs.shape == (10_000, 4, 4)
    for grid, position in zip(grids, positions, strict=True):
        assert (grid == G).sum() == 1 and grid[tuple(position)] == F
        assert frozen_lake_path(board_text(grid, position)) is not None
    # Maps really are random: about 20% holes, and nearly all maps differ.
    assert 0.1 < (grids == H).mean() < 0.25
    assert len({g.tobytes() + p.tobytes() for g, p in zip(grids, positions, strict=True)}) > 9000


def test_spaced_cells_hints_and_progress_reward():
    """`cell_separator`, `hints` and `progress_reward` on the hand-made lake, written out."""
    env, params = make("frozen_lake", cell_separator=" ", hints=True, progress_reward=0.25)
    state = hand_state((2, 1))
    assert env.render_text(state, params) == (
        "_ _ O _\n_ _ G _\nO P _ _\n_ _ _ _\n"
        "Goal: 1 Up, 1 Right. Next to you: Left hole, Down ice, Right ice, Up ice.")
    assert env.render_text(hand_state((3, 3)), params).endswith(
        "Goal: 2 Up, 1 Left. Next to you: Left ice, Down edge, Right edge, Up ice.")
    # The game is over in a hole or on the goal: no hints then.
    assert env.render_text(hand_state((1, 2)), params) == "_ _ O _\n_ _ √ _\nO _ _ _\n_ _ _ _"
    # The short style: directions towards the goal, then neighbouring holes in lower case
    # (none next to (3, 3): no "Holes" part).
    short = params.replace(hint_style="short")
    assert env.render_text(state, short).endswith("O P _ _\n_ _ _ _\nGoal: Up Right. Holes: left.")
    assert env.render_text(hand_state((3, 3)), short).endswith("_ _ _ P\nGoal: Up Left.")
    assert env.render_text(hand_state((0, 3)), short).endswith("Goal: Down Left. Holes: left.")
    with pytest.raises(ValueError, match="hint_style must be one of"):
        make("frozen_lake", hints=True, hint_style="terse")
    step = jax.jit(env.step_env)
    key = jax.random.key(0)
    # Manhattan distance to the goal (1, 2) from (2, 1) is 2: Up or Right gains 1, Down
    # loses 1, and Left falls into the hole at (2, 0), which is also one step further.
    for action, (reward, done) in {UP: (0.25, False), RIGHT: (0.25, False),
                                   DOWN: (-0.25, False), LEFT: (-0.25, True)}.items():
        _, _, r, d, _ = step(key, state, action, params)
        assert (float(r), bool(d)) == (reward, done), env.action_names[action]
    _, _, r, d, _ = step(key, hand_state((1, 1)), RIGHT, params)  # onto the goal: 1 + 0.25
    assert (float(r), bool(d)) == (1.25, True)
    # hole_penalty: Left into the hole now costs 1 on top of the step away (−0.25).
    penalised = params.replace(hole_penalty=1.0)
    assert float(step(key, state, LEFT, penalised)[2]) == -1.25
    assert float(step(key, state, UP, penalised)[2]) == 0.25
    with pytest.raises(ValueError, match="hole_penalty must be >= 0"):
        make("frozen_lake", hole_penalty=-1.0)
    # bump_penalty: from (3, 3) Down and Right walk into the edge and leave the player in
    # place (progress 0); only those moves pay it.
    bumping = params.replace(bump_penalty=0.5)
    corner = hand_state((3, 3))
    for action, reward in {DOWN: -0.5, RIGHT: -0.5, UP: 0.25, LEFT: 0.25}.items():
        assert float(step(key, corner, action, bumping)[2]) == reward, env.action_names[action]
    assert float(step(key, corner, DOWN, params)[2]) == 0.0
    with pytest.raises(ValueError, match="bump_penalty must be >= 0"):
        make("frozen_lake", bump_penalty=-0.1)
    # The usual sparse reward and compact board by default.
    plain_env, plain = make("frozen_lake")
    assert plain_env.render_text(state, plain) == "__O_\n__G_\nOP__\n____"
    assert float(step(key, state, UP, plain)[2]) == 0.0


def test_brief_instructions_still_name_the_actions_and_the_reply_format():
    env, params = make("frozen_lake", brief_instructions=True)
    brief, full = env.instructions(params), env.instructions(make("frozen_lake")[1])
    assert "<answer>ACTION</answer>" in brief and "Left, Down, Right, Up" in brief
    assert "\n" not in brief and len(brief) < len(full) / 4
    assert env.parse_action("<answer>Up</answer>") == UP


def test_sparse_lakes_are_redrawn_until_solvable():
    env, params = make("frozen_lake", size=5, p_frozen=0.5)
    keys = jax.random.split(jax.random.key(1), 500)
    _, states = jax.jit(jax.vmap(env.reset, in_axes=(0, None)))(keys, params)
    for grid, position in zip(np.asarray(states.grid), np.asarray(states.position), strict=True):
        assert frozen_lake_path(board_text(grid, position)) is not None


def test_render_text_and_rgb_of_hand_made_state(env_and_params):
    env, params = env_and_params
    state = hand_state()
    assert env.render_text(state, params) == "__O_\n_PG_\nO___\n____"
    assert env.render_text(hand_state((2, 0)), params) == "__O_\n__G_\nX___\n____"
    assert env.render_text(hand_state((1, 2)), params) == "__O_\n__√_\nO___\n____"
    image = env.render_rgb(state, params)
    assert image.dtype == np.uint8 and image.shape == (64, 64, 3)
    centre = image[8::16, 8::16]  # one pixel per cell
    frozen, hole, goal, player = centre[0, 0], centre[0, 2], centre[1, 2], centre[1, 1]
    colours = {tuple(frozen), tuple(hole), tuple(goal), tuple(player)}
    assert len(colours) == 4
    fallen = env.render_rgb(hand_state((2, 0)), params)[8::16, 8::16]
    on_goal = env.render_rgb(hand_state((1, 2)), params)[8::16, 8::16]
    assert len(colours | {tuple(fallen[2, 0]), tuple(on_goal[1, 2])}) == 6


@pytest.mark.parametrize(
    "position, action, expected, reward, terminated, effective",
    [
        ((1, 1), RIGHT, (1, 2), 1.0, True, True),  # onto the goal
        ((1, 0), DOWN, (2, 0), 0.0, True, True),  # into a hole
        ((1, 1), UP, (0, 1), 0.0, False, True),  # plain move
        ((0, 0), LEFT, (0, 0), 0.0, False, False),  # off the edge: valid, no effect
        ((0, 0), UP, (0, 0), 0.0, False, False),
    ],
)
def test_step_semantics(
    env_and_params, step_env, position, action, expected, reward, terminated, effective
):
    env, params = env_and_params
    state = hand_state(position, time=5)
    obs, nxt, r, term, info = step_env(jax.random.key(0), state, action, params)
    assert tuple(np.asarray(nxt.position)) == expected and int(nxt.time) == 6
    assert float(r) == reward and bool(term) == terminated
    assert bool(info["action_is_valid"]) and bool(info["action_is_effective"]) == effective
    assert bool(info["success"]) == (reward == 1.0)
    grid = np.asarray(state.grid)
    assert env.render_text(nxt, params) == board_text(grid, expected)
    np.testing.assert_array_equal(obs, env.symbol_grid(nxt, params))


@pytest.mark.parametrize("penalty", [0.1, 0.25])
def test_invalid_action_keeps_state_and_costs_the_format_penalty(penalty):
    env, params = make("frozen_lake", format_penalty=penalty, max_steps_in_episode=2)
    state = hand_state((1, 1), time=0)
    _, nxt, r, term, info = env.step_env(jax.random.key(0), state, INVALID_ACTION, params)
    assert env.state_hash(nxt) == env.state_hash(state) and int(nxt.time) == 1
    np.testing.assert_array_equal(nxt.grid, state.grid)
    np.testing.assert_array_equal(nxt.position, state.position)
    assert float(r) == pytest.approx(-penalty) and not bool(term)
    assert not bool(info["action_is_valid"]) and not bool(info["action_is_effective"])
    assert not bool(info["success"])
    # The clock still runs: the second invalid reply hits max_steps_in_episode=2.
    _, _, r, term, trunc, info = env.step(jax.random.key(1), nxt, INVALID_ACTION, params)
    assert not bool(term) and bool(trunc) and float(r) == pytest.approx(-penalty)


def test_slippery_moves_go_each_way_a_third_of_the_time():
    env, params = make("frozen_lake", is_slippery=True)
    grid = jnp.zeros((3, 3), jnp.int32).at[2, 2].set(G)
    state = FrozenLakeState(grid=grid, position=jnp.array([1, 1], jnp.int32), time=jnp.int32(0))
    keys = jax.random.split(jax.random.key(7), 6000)
    step = jax.jit(jax.vmap(env.step_env, in_axes=(0, None, None, None)))
    _, nxt, _, _, _ = step(keys, state, UP, params)
    moved = [tuple(p) for p in np.asarray(nxt.position)]
    counts = {cell: moved.count(cell) / len(moved) for cell in set(moved)}
    # Up from the centre: up (0,1), or perpendicular left (1,0) / right (1,2); never down.
    assert set(counts) == {(0, 1), (1, 0), (1, 2)}
    for share in counts.values():
        assert abs(share - 1 / 3) < 0.03  # 5 standard deviations at n=6000
    _, straight, _, _, _ = step(keys, state, UP, params.replace(is_slippery=False))
    assert {tuple(p) for p in np.asarray(straight.position)} == {(0, 1)}


def test_termination_auto_resets_and_reports_the_final_observation(env_and_params):
    env, params = env_and_params
    state = hand_state((1, 1), time=3)
    obs, nxt, r, term, trunc, info = env.step(jax.random.key(3), state, RIGHT, params)
    assert bool(term) and not bool(trunc) and float(r) == 1.0 and bool(info["success"])
    final = np.asarray(info["final_observation"])
    assert "".join(env.symbols[c] for c in final.reshape(-1)) == "__O___√_O_______"
    assert int(nxt.time) == 0 and nxt.grid.shape == (4, 4)  # a fresh default-size map
    np.testing.assert_array_equal(obs, env.symbol_grid(nxt, params))


def test_vmapped_step_of_4096_envs_matches_a_numpy_reference(env_and_params):
    env, params = env_and_params
    n = 4096
    key_reset, key_act, key_step = jax.random.split(jax.random.key(11), 3)
    _, states = jax.vmap(env.reset, in_axes=(0, None))(jax.random.split(key_reset, n), params)
    actions = jax.random.randint(key_act, (n,), -1, 4)
    step = jax.jit(jax.vmap(env.step, in_axes=(0, 0, 0, None)))
    out = step(jax.random.split(key_step, n), states, actions, params)
    _, _, rewards, term, trunc, info = jax.device_get(out)
    grids, positions = np.asarray(states.grid), np.asarray(states.position)
    moves = {LEFT: (0, -1), DOWN: (1, 0), RIGHT: (0, 1), UP: (-1, 0)}
    final = np.asarray(info["final_observation"])
    for i, action in enumerate(np.asarray(actions)):
        if action == INVALID_ACTION:
            expected, reward, done = tuple(positions[i]), -0.1, False
        else:
            dr, dc = moves[int(action)]
            expected = (min(max(positions[i][0] + dr, 0), 3), min(max(positions[i][1] + dc, 0), 3))
            tile = grids[i][expected]
            reward, done = float(tile == G), tile in (H, G)
        assert rewards[i] == pytest.approx(reward) and bool(term[i]) == done
        text = "\n".join("".join(env.symbols[c] for c in row) for row in final[i])
        assert text == board_text(grids[i], expected)
        assert bool(info["action_is_valid"][i]) == (action != INVALID_ACTION)
        assert bool(info["action_is_effective"][i]) == (expected != tuple(positions[i]))
    assert not np.asarray(trunc).any()


def test_state_hash_tells_states_apart(env_and_params):
    env, _ = env_and_params
    a, b = hand_state((1, 1), time=0), hand_state((1, 1), time=0)
    assert env.state_hash(a) == env.state_hash(b)
    assert isinstance(env.state_hash(a), bytes)
    # The clock is not part of the situation (GiGPO anchors group revisits).
    assert env.state_hash(hand_state((1, 1), time=4)) == env.state_hash(a)
    assert env.state_hash(hand_state((0, 1))) != env.state_hash(a)
    other_map = a.replace(grid=a.grid.at[0, 0].set(H))
    assert env.state_hash(other_map) != env.state_hash(a)
