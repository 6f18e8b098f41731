import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxrl_agentic.envs import INVALID_ACTION, SokobanState, make
from tests.envs.solvers import STEPS, parse_sokoban, sokoban_path

UP, DOWN, LEFT, RIGHT = 0, 1, 2, 3
NAMES = ("Up", "Down", "Left", "Right")

# Two boxes: the top one is a push away from its target, the lower one two pushes.
BOARD = "\n".join(["######", "#PXO_#", "#____#", "#_X_O#", "#____#", "######"])


def state_from_board(board: str, time: int = 0) -> SokobanState:
    walls, targets, boxes, player = parse_sokoban(board)
    rows = board.split("\n")
    shape = (len(rows), len(rows[0]))

    def mask(cells):
        grid = np.zeros(shape, bool)
        for cell in cells:
            grid[cell] = True
        return jnp.asarray(grid)

    return SokobanState(
        walls=mask(walls), targets=mask(targets), boxes=mask(boxes),
        player=jnp.array(player, jnp.int32), time=jnp.int32(time),
    )


def board_of(state: SokobanState) -> str:
    """Independent rendering of the documented symbols."""
    walls, targets, boxes = (np.asarray(a) for a in (state.walls, state.targets, state.boxes))
    player = tuple(np.asarray(state.player))
    lines = []
    for r in range(walls.shape[0]):
        line = ""
        for c in range(walls.shape[1]):
            if (r, c) == player:
                line += "S" if targets[r, c] else "P"
            elif boxes[r, c]:
                line += "√" if targets[r, c] else "X"
            else:
                line += "#" if walls[r, c] else ("O" if targets[r, c] else "_")
        lines.append(line)
    return "\n".join(lines)


@pytest.fixture(scope="module")
def env_and_params():
    return make("sokoban")


@pytest.fixture(scope="module")
def step_env(env_and_params):
    return jax.jit(env_and_params[0].step_env)


def cells(mask: np.ndarray) -> set:
    return {tuple(int(i) for i in rc) for rc in np.argwhere(mask)}


@pytest.mark.parametrize(
    "overrides, count",
    [
        ({}, 2000),
        ({"num_boxes": 2}, 2000),
        ({"dim_room": 8, "num_boxes": 2}, 300),  # the BFS is slower here: fewer levels
    ],
)
def test_generated_levels_are_solvable_and_start_unsolved(overrides, count):
    env, params = make("sokoban", **overrides)
    dim, num_boxes = params.dim_room, params.num_boxes
    keys = jax.random.split(jax.random.key(len(overrides)), count)
    _, states = jax.jit(jax.vmap(env.reset, in_axes=(0, None)))(keys, params)
    walls, targets, boxes, players = jax.device_get(
        (states.walls, states.targets, states.boxes, states.player)
    )
    assert walls.shape == (count, dim, dim)
    edge = (0, dim - 1)
    border = {(r, c) for r in range(dim) for c in range(dim) if r in edge or c in edge}
    for i in range(count):
        wall_cells, target_cells, box_cells = cells(walls[i]), cells(targets[i]), cells(boxes[i])
        player = tuple(int(x) for x in players[i])
        assert border <= wall_cells
        assert len(box_cells) == len(target_cells) == num_boxes
        assert not box_cells & target_cells  # no box starts on a target
        assert not (box_cells | target_cells | {player}) & wall_cells
        assert player not in box_cells
        path = sokoban_path(wall_cells, target_cells, box_cells, player)
        assert path, f"level {i} unsolvable:\n{board_of(jax.tree.map(lambda a, i=i: a[i], states))}"
    # Levels differ from each other.
    levels = zip(walls, boxes, targets, strict=True)
    distinct = {w.tobytes() + b.tobytes() + t.tobytes() for w, b, t in levels}
    assert len(distinct) > count // 2


def test_reference_solver_detects_unsolvable_levels():
    # A box in a corner can never move again: the solver must say so, else the test above
    # could not fail.
    board = "\n".join(["#####", "#X__#", "#_P_#", "#__O#", "#####"])
    assert sokoban_path(*parse_sokoban(board)) is None
    assert sokoban_path(*parse_sokoban(BOARD.replace("PXO", "_XO").replace("#_X_O#", "#PX_O#")))


def test_render_text_rgb_and_hash_of_hand_made_state(env_and_params):
    env, params = env_and_params
    state = state_from_board(BOARD)
    assert env.render_text(state, params) == BOARD
    on_target = state.replace(player=jnp.array([3, 4], jnp.int32))
    assert env.render_text(on_target, params).split("\n")[3] == "#_X_S#"
    image = env.render_rgb(state, params)
    assert image.dtype == np.uint8 and image.shape == (96, 96, 3)
    centre = image[8::16, 8::16]
    wall, floor, target = centre[0, 0], centre[2, 1], centre[1, 3]
    box, player = centre[1, 2], centre[1, 1]
    solved_box = env.render_rgb(state.replace(boxes=state.targets), params)[8::16, 8::16][1, 3]
    standing = env.render_rgb(on_target, params)[8::16, 8::16][3, 4]
    colours = {tuple(c) for c in (wall, floor, target, box, player, solved_box, standing)}
    assert len(colours) == 7
    assert env.state_hash(state) == env.state_hash(state_from_board(BOARD, time=9))
    assert env.state_hash(on_target) != env.state_hash(state)
    assert env.state_hash(state.replace(boxes=state.targets)) != env.state_hash(state)


@pytest.mark.parametrize(
    "board, action, after, reward, solved",
    [
        # push the top box onto its target: -0.1 + 1
        (BOARD, RIGHT, "#_P√_#", 0.9, False),
        # push it off again (the player lands on the target): -0.1 - 1
        (BOARD.replace("#PXO_#", "#_P√_#"), RIGHT, "#__SX#", -1.1, False),
        # walk into a wall: valid, no effect
        (BOARD, UP, "#PXO_#", -0.1, False),
        # box against a wall cannot move
        (BOARD.replace("#PXO_#", "#_OPX#"), RIGHT, "#_OPX#", -0.1, False),
        # box against a box cannot move
        (BOARD.replace("#PXO_#", "#PXX_#").replace("#_X_O#", "#___O#"), RIGHT, "#PXX_#", -0.1,
         False),
        # plain walk onto a target
        (BOARD.replace("#PXO_#", "#_XOP#"), LEFT, "#_XS_#", -0.1, False),
    ],
)
def test_step_semantics(env_and_params, step_env, board, action, after, reward, solved):
    env, params = env_and_params
    state = state_from_board(board, time=2)
    _, nxt, r, term, info = step_env(jax.random.key(0), state, action, params)
    assert env.render_text(nxt, params).split("\n")[1] == after
    assert float(r) == pytest.approx(reward) and bool(term) == solved
    assert bool(info["action_is_valid"]) and int(nxt.time) == 3
    assert bool(info["action_is_effective"]) == (board.split("\n")[1] != after)


def test_last_box_onto_target_solves_with_bonus(env_and_params):
    env, params = env_and_params
    board = BOARD.replace("#PXO_#", "#__√_#").replace("#_X_O#", "#_PXO#")
    state = state_from_board(board, time=4)
    obs, nxt, r, term, trunc, info = env.step(jax.random.key(0), state, RIGHT, params)
    assert float(r) == pytest.approx(-0.1 + 1 + 10)
    assert bool(term) and not bool(trunc) and bool(info["success"])
    final = np.asarray(info["final_observation"])
    text = "\n".join("".join(env.symbols[c] for c in row) for row in final)
    assert text == board.replace("#_PXO#", "#__P√#")
    # gymnax auto-reset: the returned state is a fresh level.
    assert int(nxt.time) == 0 and not bool(jnp.any(nxt.boxes & nxt.targets))
    np.testing.assert_array_equal(obs, env.symbol_grid(nxt, params))


def test_invalid_action_keeps_state_and_costs_the_format_penalty(env_and_params, step_env):
    env, params = env_and_params
    state = state_from_board(BOARD, time=0)
    _, nxt, r, term, info = step_env(jax.random.key(0), state, INVALID_ACTION, params)
    assert env.render_text(nxt, params) == BOARD and int(nxt.time) == 1
    assert float(r) == pytest.approx(-0.1) and not bool(term)
    assert not bool(info["action_is_valid"]) and not bool(info["action_is_effective"])
    costly = params.replace(format_penalty=0.5)
    _, _, r, _, _ = step_env(jax.random.key(0), state, INVALID_ACTION, costly)
    assert float(r) == pytest.approx(-0.5)


def reference_step(board: str, action: int) -> tuple[str, float, bool]:
    """The documented rules, on text boards."""
    walls, targets, boxes, player = parse_sokoban(board)
    if action == INVALID_ACTION:
        return board, -0.1, False
    dr, dc = STEPS[NAMES[action]]
    one = (player[0] + dr, player[1] + dc)
    two = (one[0] + dr, one[1] + dc)
    reward = -0.1
    if one in boxes and two not in walls and two not in boxes:
        boxes = (boxes - {one}) | {two}
        reward += (two in targets) - (one in targets)
        player = one
    elif one not in walls and one not in boxes:
        player = one
    solved = boxes == targets
    rows = [list(row) for row in board.split("\n")]
    for r, row in enumerate(rows):
        for c in range(len(row)):
            if (r, c) not in walls:
                row[c] = "O" if (r, c) in targets else "_"
    for r, c in boxes:
        rows[r][c] = "√" if (r, c) in targets else "X"
    rows[player[0]][player[1]] = "S" if player in targets else "P"
    return "\n".join("".join(row) for row in rows), reward + 10 * solved, solved


def test_vmapped_step_of_4096_envs_matches_a_reference(env_and_params):
    env, params = env_and_params
    n = 4096
    key_reset, key_act, key_step = jax.random.split(jax.random.key(5), 3)
    _, states = jax.vmap(env.reset, in_axes=(0, None))(jax.random.split(key_reset, n), params)
    actions = jax.random.randint(key_act, (n,), -1, 4)
    step = jax.jit(jax.vmap(env.step, in_axes=(0, 0, 0, None)))
    out = jax.device_get(step(jax.random.split(key_step, n), states, actions, params))
    _, _, rewards, term, trunc, info = out
    grids = np.asarray(jax.vmap(env.symbol_grid, in_axes=(0, None))(states, params))
    symbols = np.array(env.symbols)
    for i, action in enumerate(np.asarray(actions)):
        board = "\n".join("".join(row) for row in symbols[grids[i]])
        expected, reward, solved = reference_step(board, int(action))
        final = "\n".join("".join(row) for row in symbols[info["final_observation"][i]])
        assert final == expected
        assert rewards[i] == pytest.approx(reward) and bool(term[i]) == solved
        assert bool(info["action_is_effective"][i]) == (expected != board)
    assert not trunc.any()


def test_hints_shaping_and_bump_penalty_on_a_hand_made_level():
    """`hints`, `progress_reward` and `bump_penalty` on a one-box level, written out by hand.

    Φ = −(box-to-target distance + ½ player-to-box distance); a move is paid
    progress_reward · (Φ' − Φ) on top of the game's rewards."""
    env, params = make("sokoban", cell_separator=" ", hints=True, progress_reward=1.0,
                       bump_penalty=0.5)
    board = "\n".join(["######", "#P___#", "#____#", "#_X_O#", "#____#", "######"])
    state = state_from_board(board)
    # Box (3, 2) is 2 down and 1 right of the player (1, 1); the target (3, 4) is right of it.
    assert env.render_text(state, params) == (
        "# # # # # #\n# P _ _ _ #\n# _ _ _ _ #\n# _ X _ O #\n# _ _ _ _ #\n# # # # # #\n"
        "Box: Down Right. Target: Right.")
    step = jax.jit(env.step_env)
    key = jax.random.key(0)
    # Φ = −(2 + ½·3) = −3.5. Down or Right: player 2 from the box, Φ' = −3, +0.5 − 0.1.
    # Up and Left walk into the wall: nothing changes, −0.1 − 0.5.
    for action, reward in {DOWN: 0.4, RIGHT: 0.4, UP: -0.6, LEFT: -0.6}.items():
        assert float(step(key, state, action, params)[2]) == pytest.approx(reward), NAMES[action]
    # Pushing the box right from (3, 1): box 1 from the target (+1), player still 1 from it.
    pusher = state_from_board(board.replace("#P___#", "#____#").replace("#_X_O#", "#PX_O#"))
    assert env.render_text(pusher, params).endswith("Box: Right. Target: Right.")
    assert float(step(key, pusher, RIGHT, params)[2]) == pytest.approx(1.0 - 0.1)
    # Pushing it onto the target: Φ goes from −(1 + ½) to 0 (the player term is 0 once no
    # box is off a target), +1 box on target, +10 solved, −0.1 a step.
    last = state_from_board(board.replace("#P___#", "#____#").replace("#_X_O#", "#_PXO#"))
    assert float(step(key, last, RIGHT, params)[2]) == pytest.approx(1.5 + 1 + 10 - 0.1)
    # A box against the wall does not move: a bump. The target is left of the box.
    stuck = state_from_board(board.replace("#P___#", "#____#").replace("#_X_O#", "#_OPX#"))
    assert float(step(key, stuck, RIGHT, params)[2]) == pytest.approx(-0.6)
    assert env.render_text(stuck, params).endswith("Box: Right. Target: Left.")
    # Solved: the game is over, no hint line.
    solved = state_from_board(board.replace("#_X_O#", "#___√#"))
    assert env.render_text(solved, params) == env.render_text(solved, params.replace(hints=False))
    # Shaping telescopes over a walk: Down, Down, Right (push: box to (3, 3)), Up, Right,
    # Right ends with the box 1 from its target and the player at (2, 4), 2 from the box:
    # Φ(end) − Φ(start) = −(1 + 1) + 3.5 = 1.5.
    game = params.replace(progress_reward=0.0, bump_penalty=0.0)
    shaping, s = 0.0, state
    for action in (DOWN, DOWN, RIGHT, UP, RIGHT, RIGHT):
        _, after, r, _, _ = step(key, s, action, params)
        shaping, s = shaping + float(r) - float(step(key, s, action, game)[2]), after
    assert shaping == pytest.approx(1.5)
    assert env.render_text(s, params).split("\n")[2:4] == ["# _ _ _ P #", "# _ _ X O #"]
    with pytest.raises(ValueError, match="bump_penalty must be >= 0"):
        make("sokoban", bump_penalty=-1.0)
    # Off by default: the game's own rewards and a board without hints.
    plain_env, default = make("sokoban")
    assert plain_env.render_text(state, default) == board
    assert float(step(key, state, UP, default)[2]) == pytest.approx(-0.1)


def test_blocked_hints_name_exactly_the_moves_that_change_nothing():
    """`blocked_hints` on hand-made positions, and on random levels against the game's own
    transition: a move is named iff stepping it leaves the board as it was."""
    env, params = make("sokoban", cell_separator=" ", hints=True, blocked_hints=True)
    board = "\n".join(["######", "#P___#", "#____#", "#_X_O#", "#____#", "######"])
    corner = state_from_board(board)
    assert env.render_text(corner, params).endswith(
        "Box: Down Right. Target: Right. Blocked: Up Left.")
    # A box against the wall on the right: pushing it is blocked, the rest are free.
    stuck = state_from_board(board.replace("#P___#", "#____#").replace("#_X_O#", "#_OPX#"))
    assert env.render_text(stuck, params).endswith("Box: Right. Target: Left. Blocked: Right.")
    # Nothing blocked: no third sentence.
    open_ = state_from_board(board.replace("#P___#\n#____#", "#____#\n#_P__#"))
    assert env.render_text(open_, params).endswith("Box: Down. Target: Right.")
    assert env.render_text(corner, params.replace(blocked_hints=False)).endswith(
        "Target: Right.")

    step = jax.jit(env.step_env)
    reset = jax.jit(env.reset_env)
    key = jax.random.key(3)
    seen = {True: 0, False: 0}
    for level in range(24):
        _, state = reset(jax.random.fold_in(key, level), params)
        for _ in range(4):  # a few random moves, so the player stands next to walls and boxes
            text = env.render_text(state, params)
            if "Box: " not in text:  # solved: the game is over, no hint line
                break
            named = text.split("Blocked: ")[1].rstrip(".").split() if "Blocked: " in text else []
            for action, name in enumerate(NAMES):
                after = step(key, state, action, params)[1]
                unchanged = board_of(after) == board_of(state)
                assert (name in named) == unchanged, (board_of(state), name)
                seen[unchanged] += 1
            level_key = jax.random.fold_in(key, 100 + level)
            state = step(key, state, int(jax.random.randint(level_key, (), 0, 4)), params)[1]
    assert seen[True] > 10 and seen[False] > 10  # both cases were checked


def reference_push_potential(board: str) -> float:
    """Φ with `push_potential`, from the module doc's words, in plain Python."""
    walls, targets, boxes, player = parse_sokoban(board)

    def d(a, b):
        return abs(a[0] - b[0]) + abs(a[1] - b[1])

    boxes_term = sum(min(d(b, t) for t in targets) for b in boxes)
    loose = sorted(b for b in boxes if b not in targets)
    if not loose:
        return -boxes_term
    free = sorted(t for t in targets if t not in boxes)
    cells = []
    for b in loose:
        t = min(free, key=lambda t, b=b: d(b, t))  # ties: the first in row-major order
        behind = []
        if t[0] != b[0]:
            behind.append((b[0] - (1 if t[0] > b[0] else -1), b[1]))
        if t[1] != b[1]:
            behind.append((b[0], b[1] - (1 if t[1] > b[1] else -1)))
        behind = [cell for cell in behind if cell not in walls]
        cells.extend(behind or [b])
    return -(boxes_term + 0.5 * min(d(player, cell) for cell in cells))


def test_push_potential_pays_for_walking_round_the_box():
    env, params = make("sokoban", progress_reward=1.0, push_potential=True)
    step = jax.jit(env.step_env)
    key = jax.random.key(0)
    # The player is right of the box, whose target is right of it too: the push cell is
    # left of the box (3, 1), 2 away as the crow flies, 4 by the walk round the box.
    board = "\n".join(["######", "#____#", "#____#", "#_XPO#", "#____#", "######"])
    state = state_from_board(board)
    # Up: 3 from the push cell (−0.5); then Left, Left, Down each 1 closer (+0.5); then the
    # push Right: box 1 closer (+1), the player lands on the new push cell (0).
    rewards = []
    for action in (UP, LEFT, LEFT, DOWN, RIGHT):
        _, state, r, _, _ = step(key, state, action, params)
        rewards.append(float(r))
    assert rewards == pytest.approx([-0.6, 0.4, 0.4, 0.4, 0.9])
    # Box distance alone (the default): walking away from the box costs on every step.
    plain = params.replace(push_potential=False)
    state = state_from_board(board)
    rewards = []
    for action in (UP, LEFT, LEFT, DOWN):
        _, state, r, _, _ = step(key, state, action, plain)
        rewards.append(float(r))
    assert rewards == pytest.approx([-0.6, 0.4, -0.6, 0.4])


@pytest.mark.parametrize("num_boxes", [1, 2])
def test_push_potential_matches_a_reference_on_generated_positions(num_boxes):
    from jaxrl_agentic.envs.sokoban import potential

    env, params = make("sokoban", num_boxes=num_boxes)
    phi = jax.jit(lambda s: potential(s, True))
    step = jax.jit(env.step_env)
    rng = np.random.default_rng(num_boxes)
    for key in jax.random.split(jax.random.key(7), 12):
        _, state = env.reset_env(key, params)
        for action in rng.integers(0, 4, size=8):
            board = board_of(state)
            assert float(phi(state)) == pytest.approx(reference_push_potential(board)), board
            _, state, _, _, _ = step(key, state, int(action), params)


def test_revisit_penalty_charges_a_move_back_to_a_remembered_position():
    env, params = make("sokoban", revisit_penalty=1.0, revisit_memory=2)
    step = jax.jit(env.step_env)
    key = jax.random.key(0)
    board = "\n".join(["######", "#____#", "#____#", "#__P_#", "#_XO_#", "######"])
    memory = 2
    base = state_from_board(board)
    state = base.replace(seen_boxes=jnp.zeros((memory, 6, 6), bool).at[0].set(base.boxes),
                         seen_players=jnp.zeros((memory, 2), jnp.int32).at[0].set(base.player),
                         seen_count=jnp.int32(1))
    # Positions: start s0 (3, 3); Up → s1 (2, 3); Up → s2 (1, 3), overwriting s0 in the
    # memory of 2; Up bumps the wall (no change, no revisit, memory kept); Down → s1 again:
    # remembered, −1; Down → s0: forgotten by now, no penalty.
    expected = [-0.1, -0.1, -0.1, -1.1, -0.1]
    rewards, hashes = [], [env.state_hash(state)]
    for action in (UP, UP, UP, DOWN, DOWN):
        _, state, r, _, info = step(key, state, action, params)
        rewards.append(float(r))
        hashes.append(env.state_hash(state))
    assert rewards == pytest.approx(expected)
    # Back at s0 with another history: the same GiGPO anchor state as at the start.
    assert hashes[-1] == hashes[0] and hashes[-1] != hashes[1]
    # A reset fills the memory with the start position only.
    _, fresh = env.reset_env(key, params)
    assert int(fresh.seen_count) == 1
    assert bool(jnp.all(fresh.seen_boxes[0] == fresh.boxes))
    with pytest.raises(ValueError, match="revisit_penalty needs revisit_memory >= 1"):
        make("sokoban", revisit_penalty=1.0)
