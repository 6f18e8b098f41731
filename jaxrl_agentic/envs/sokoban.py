"""Sokoban with random solvable levels generated in JAX by reverse play.

Rules: the player pushes boxes (never pulls) onto targets. A move into a wall, or into a
box whose far side is a wall or another box, leaves everything in place (valid, not
effective). Rewards per step:

    -0.1                          every valid step
    +1 / -1                       a box pushed onto / off a target
    +10                           every box is on a target (the episode terminates)

Optional help for small models (off by default; the rules and levels are unchanged):

    + progress_reward · (Φ(s') − Φ(s)),  Φ = −(Σ_boxes d(box, nearest target)
                                              + ½ d(player, nearest box off a target))
    − bump_penalty                a move that changed nothing (wall, or a blocked box)

d is the Manhattan distance. With `push_potential` the player term is ½ d(player, nearest
push cell): a cell from which a push moves a box off a target towards its nearest free
target (the cell behind it on that axis). Measured with a solver over every reachable
position of 200 generated 6×6 levels (3,819 solvable ones), the move the one-step shaped
reward ranks first is a shortest-solution move in 45% of positions with the distance to the
box and in 75% with the distance to the push cell; a shortest-solution move is penalised
in 31% against 14%. Walking round a box to push it costs under the first and pays under
the second. The progress term is potential-based shaping (Ng et al. 1999):
summed over an episode it telescopes to Φ(end) − Φ(start), so it rewards each move by how
much closer it brings the level to solved without changing which policies are optimal
for the undiscounted return. `hints` add a line after the board naming the directions from
the player to the nearest box off a target and from that box to its nearest free target
("Box: Up Right. Target: Down."), so each fact a move depends on is a token of its own, as
FrozenLake's short hints do. `blocked_hints` add the moves that would change nothing
("Blocked: Up Left."): a greedy policy that makes one such move sees the same board again
and repeats it until the episode ends.

Level generation (`generate_level`), all inside JAX so `reset` stays jittable and vmappable:
  1. Room: border walls; the interior starts as wall and a random walk of `num_carve_steps`
     moves carves floor (so the floor is connected and inner walls vary per level).
  2. Solved state: `num_boxes` boxes placed on targets on distinct floor cells, the player
     on another floor cell.
  3. Reverse play: `num_reverse_steps` random player moves; a move away from an adjacent
     box pulls it along. Each pull undoes a legal push, so from every position of this walk
     playing it backwards solves the level: every position is solvable by construction.
     The level is the last position of the walk, among those with no box on a target,
     with the highest score = sum over boxes of the Manhattan distance to the nearest
     target + the player's distance to the nearest box (a rough proxy for solution
     length: on 6x6 with one box the median shortest solution is 4 moves, 22% of levels
     take at most 2; taking the walk's end gives a median of 3 and 48%).
  4. A walk that never had every box off its target (or a room with too little floor
     for the boxes and the player) is redrawn.
"""

import jax
import jax.numpy as jnp
import numpy as np
from flax import struct

from jaxrl_agentic.envs.base import (
    TextEnvironment,
    TextEnvParams,
    format_instructions,
    sample_until,
    uniform_ints,
)

# Symbol codes of `symbol_grid`.
WALL, FLOOR, TARGET, BOX, BOX_ON_TARGET, PLAYER, PLAYER_ON_TARGET = range(7)
SYMBOLS = ("#", "_", "O", "X", "√", "P", "S")
SYMBOL_COLORS = (
    (70, 70, 70),  # wall: dark grey
    (225, 225, 210),  # floor: off-white
    (240, 150, 150),  # target: pink
    (160, 100, 40),  # box: brown
    (60, 170, 70),  # box on target: green
    (40, 90, 220),  # player: blue
    (140, 60, 200),  # player on target: violet
)
ACTION_NAMES = ("Up", "Down", "Left", "Right")
MOVES = jnp.array([[-1, 0], [1, 0], [0, -1], [0, 1]], jnp.int32)  # (row, col) per action

STEP_REWARD = -0.1
BOX_ON_TARGET_REWARD = 1.0
SOLVED_REWARD = 10.0


@struct.dataclass
class SokobanState:
    walls: jax.Array  # bool [dim, dim]
    targets: jax.Array  # bool [dim, dim]
    boxes: jax.Array  # bool [dim, dim]
    player: jax.Array  # int32 [2] (row, col)
    time: jax.Array
    # With `revisit_memory` K > 0: the last K positions since the reset, a ring written on
    # every move that changed something (None when K = 0).
    seen_boxes: jax.Array | None = None  # bool [K, dim, dim]
    seen_players: jax.Array | None = None  # int32 [K, 2]
    seen_count: jax.Array | None = None  # int32: positions written so far


@struct.dataclass
class SokobanParams(TextEnvParams):
    """dim_room: side of the square room, border walls included.
    num_boxes: boxes (= targets) per level.
    num_reverse_steps: random moves of reverse play; None = 16 * (dim_room - 2) * num_boxes.
    num_carve_steps: random-walk moves that carve the floor; None = 2 * (dim_room - 2) ** 2.
    All four are static (they set shapes and loop lengths); changing one recompiles.

    progress_reward: weight of the potential-based shaping term (module doc); 0 = off.
    push_potential: the player term of Φ measures the walk to the cell a box is pushed
        from towards its target, not to the box (module doc).
    bump_penalty: reward −= bump_penalty for a valid move that changed nothing.
    revisit_penalty: reward −= revisit_penalty for a move that changed something and led
        back to one of the last `revisit_memory` positions (the boxes and the player) of
        the episode; `revisit_memory` (static) sets the memory's size, 0 = off.
    hints: a line after the board, "Box: <dirs>. Target: <dirs>." (module doc).
    blocked_hints: with `hints`, the line also names the moves that would change nothing
        ("Blocked: <actions>.", when there are any).
    brief_instructions: a two-line instruction text (~40 tokens instead of ~200), for a
        small model trained from scratch that reads no English.
    """

    dim_room: int = struct.field(pytree_node=False, default=6)
    num_boxes: int = struct.field(pytree_node=False, default=1)
    num_reverse_steps: int | None = struct.field(pytree_node=False, default=None)
    num_carve_steps: int | None = struct.field(pytree_node=False, default=None)
    progress_reward: float = 0.0
    push_potential: bool = struct.field(pytree_node=False, default=False)
    bump_penalty: float = 0.0
    revisit_penalty: float = 0.0
    revisit_memory: int = struct.field(pytree_node=False, default=0)
    hints: bool = struct.field(pytree_node=False, default=False)
    blocked_hints: bool = struct.field(pytree_node=False, default=False)
    brief_instructions: bool = struct.field(pytree_node=False, default=False)


def resolved_steps(params: SokobanParams) -> tuple[int, int]:
    """(num_reverse_steps, num_carve_steps) with the None defaults filled in."""
    interior = params.dim_room - 2
    reverse = params.num_reverse_steps
    carve = params.num_carve_steps
    reverse = 16 * interior * params.num_boxes if reverse is None else reverse
    carve = 2 * interior * interior if carve is None else carve
    return reverse, carve


def carve_room(start: jax.Array, moves: jax.Array, dim: int) -> jax.Array:
    """bool [dim, dim] floor: the cells a walk from `start` visits, kept off the border."""

    def walk(position, move):
        position = jnp.clip(position + move, 1, dim - 2)
        return position, position

    _, visited = jax.lax.scan(walk, start, moves)
    visited = jnp.concatenate([start[None], visited])
    flat = visited[:, 0] * dim + visited[:, 1]
    return jnp.any(flat[:, None] == jnp.arange(dim * dim), axis=0).reshape(dim, dim)


def distance_to_nearest(targets: jax.Array) -> jax.Array:
    """int32 grid: Manhattan distance from each cell to the nearest True cell of `targets`."""
    rows, cols = targets.shape
    r, c = jnp.divmod(jnp.arange(rows * cols), cols)
    distance = jnp.abs(r[:, None] - r[None, :]) + jnp.abs(c[:, None] - c[None, :])
    far = rows + cols  # more than any distance on the grid
    nearest = jnp.min(jnp.where(targets.reshape(-1)[None, :], distance, far), axis=1)
    return nearest.reshape(rows, cols).astype(jnp.int32)


def walk_to_nearest(position: jax.Array, cells: jax.Array) -> jax.Array:
    """Manhattan distance from `position` (row, col) to the nearest True cell of `cells`;
    rows + cols (more than any distance on the grid) when there is none."""
    rows, cols = jnp.indices(cells.shape)
    from_position = jnp.abs(rows - position[0]) + jnp.abs(cols - position[1])
    return jnp.min(jnp.where(cells, from_position, sum(cells.shape)))


def push_cells(state: SokobanState) -> jax.Array:
    """bool grid: the cells a player pushes a box off a target from, towards that box's
    nearest free target (Manhattan; ties: the first in row-major order).

    A box with its target up and to the right is pushed Up from the cell below it or Right
    from the cell left of it; one in line with its target has one such cell. Walls are not
    push cells. A box with neither (both are walls) contributes its own cell instead, so the
    player term still leads somewhere.
    """
    rows, cols = state.boxes.shape
    r, c = jnp.divmod(jnp.arange(rows * cols), cols)
    distance = jnp.abs(r[:, None] - r[None, :]) + jnp.abs(c[:, None] - c[None, :])
    free = (state.targets & ~state.boxes).reshape(-1)
    nearest = jnp.argmin(jnp.where(free[None, :], distance, rows + cols), axis=1)
    dr, dc = jnp.sign(r[nearest] - r), jnp.sign(c[nearest] - c)
    walls = state.walls.reshape(-1)
    loose = (state.boxes & ~state.targets).reshape(-1)
    # Behind each box along each axis it must travel (dr or dc is 0: no push that way).
    behind_v = jnp.clip(r - dr, 0, rows - 1) * cols + c
    behind_h = r * cols + jnp.clip(c - dc, 0, cols - 1)
    use_v = loose & (dr != 0) & ~walls[behind_v]
    use_h = loose & (dc != 0) & ~walls[behind_h]
    fallback = loose & ~use_v & ~use_h
    cells = jnp.zeros(rows * cols, bool)
    cells = cells.at[behind_v].max(use_v).at[behind_h].max(use_h) | fallback
    return cells.reshape(rows, cols)


def potential(state: SokobanState, to_push_cell: bool = False) -> jax.Array:
    """Φ of the module doc: −(Σ_boxes d(box, nearest target) + ½ d(player, G)); the player
    term is 0 once every box is on a target. G: the boxes off a target, or with
    `to_push_cell` the cells to push them from (`push_cells`)."""
    to_target = distance_to_nearest(state.targets)
    boxes_term = jnp.sum(jnp.where(state.boxes, to_target, 0))
    loose = state.boxes & ~state.targets
    goal = push_cells(state) if to_push_cell else loose
    walk = jnp.where(jnp.any(loose), walk_to_nearest(state.player, goal), 0)
    return -(boxes_term + 0.5 * walk).astype(jnp.float32)


def directions(source: tuple[int, int], dest: tuple[int, int]) -> str:
    """The action names that lead from `source` towards `dest`, vertical first ("Up Right");
    "here" when they are the same cell."""
    (r0, c0), (r1, c1) = source, dest
    names = (["Down" if r1 > r0 else "Up"] if r1 != r0 else []) + \
        (["Right" if c1 > c0 else "Left"] if c1 != c0 else [])
    return " ".join(names) or "here"


def reverse_play(floor: jax.Array, targets: jax.Array, player: jax.Array, moves: jax.Array):
    """Reverse play from all boxes on `targets` (module doc, step 3).

    Returns (boxes, player, found): the chosen position, and whether any position of the
    walk had every box off its target. Requires walls on the border of `floor` (so the
    player's neighbours stay in bounds).
    """
    distance = distance_to_nearest(targets)

    def pull_step(carry, move):
        boxes, player, best = carry
        ahead, behind = player + move, player - move
        can_move = floor[ahead[0], ahead[1]] & ~boxes[ahead[0], ahead[1]]
        pull = can_move & boxes[behind[0], behind[1]]
        pulled = boxes.at[behind[0], behind[1]].set(False).at[player[0], player[1]].set(True)
        boxes = jnp.where(pull, pulled, boxes)
        player = jnp.where(can_move, ahead, player)
        box_distance = jnp.sum(jnp.where(boxes, distance, 0))
        walk_to_box = walk_to_nearest(player, boxes)
        # Boxes off target are >= 1 from one, so a valid position scores >= num_boxes > 0.
        score = jnp.where(jnp.any(boxes & targets), 0, box_distance + walk_to_box)
        better = score >= best[2]  # ties: the later position, after more walking
        best = jax.tree.map(lambda new, old: jnp.where(better, new, old),
                            (boxes, player, score), best)
        return (boxes, player, best), None

    start = (targets, player, (targets, player, jnp.int32(0)))
    (_, _, (boxes, player, score)), _ = jax.lax.scan(pull_step, start, moves)
    return boxes, player, score > 0


def draw_level(key, dim: int, num_boxes: int, num_reverse_steps: int, num_carve_steps: int):
    """One candidate (level, acceptable): steps 1-3 of the module doc, and the step-4 check."""
    cells = dim * dim
    # One draw of random bits for the whole level: each separate jax.random call adds its
    # own threefry computation to the compiled program, and compile time dominates here.
    bits = jax.random.bits(key, (2 + num_carve_steps + cells + num_reverse_steps,), jnp.uint32)
    start = 1 + uniform_ints(bits[:2], dim - 2)
    carve_moves = MOVES[uniform_ints(bits[2 : 2 + num_carve_steps], 4)]
    priority = (bits[2 + num_carve_steps : 2 + num_carve_steps + cells] >> 1).astype(jnp.int32)
    reverse_moves = MOVES[uniform_ints(bits[2 + num_carve_steps + cells :], 4)]

    floor = carve_room(start, carve_moves, dim)
    # The num_boxes + 1 floor cells of highest random priority: a uniform random subset.
    _, chosen = jax.lax.top_k(jnp.where(floor.reshape(-1), priority, -1), num_boxes + 1)
    enough_floor = jnp.all(floor.reshape(-1)[chosen])
    targets = jnp.zeros(cells, bool).at[chosen[:num_boxes]].set(True).reshape(dim, dim)
    player = jnp.stack(jnp.divmod(chosen[num_boxes], dim)).astype(jnp.int32)
    boxes, player, found = reverse_play(floor, targets, player, reverse_moves)
    level = SokobanState(
        walls=~floor, targets=targets, boxes=boxes, player=player, time=jnp.int32(0)
    )
    return level, enough_floor & found


def generate_level(key: jax.Array, params: SokobanParams) -> SokobanState:
    """A solvable level with no box on a target, redrawn until acceptable (module doc)."""
    reverse, carve = resolved_steps(params)
    return sample_until(
        key, lambda k: draw_level(k, params.dim_room, params.num_boxes, reverse, carve)
    )


def _cell(grid: jax.Array, position: jax.Array, outside):
    """grid[position], or `outside` when position lies off the grid."""
    rows, cols = grid.shape
    inside = (position[0] >= 0) & (position[0] < rows) & (position[1] >= 0) & (position[1] < cols)
    value = grid[jnp.clip(position[0], 0, rows - 1), jnp.clip(position[1], 0, cols - 1)]
    return jnp.where(inside, value, outside)


def blocked_moves(walls: np.ndarray, boxes: np.ndarray, player: tuple[int, int]) -> list[str]:
    """The action names whose move changes nothing (`Sokoban.transition`'s rule, on the
    host): a wall or the edge ahead, or a box ahead with a wall, a box or the edge behind."""

    def free(cell, grid):
        r, c = cell
        inside = 0 <= r < grid.shape[0] and 0 <= c < grid.shape[1]
        return inside and not grid[r, c]

    blocked = []
    for name, (dr, dc) in zip(ACTION_NAMES, np.asarray(MOVES).tolist(), strict=True):
        one = (player[0] + dr, player[1] + dc)
        two = (player[0] + 2 * dr, player[1] + 2 * dc)
        box_ahead = not free(one, boxes)
        walk = free(one, walls) and not box_ahead
        push = box_ahead and free(one, walls) and free(two, walls) and free(two, boxes)
        if not (walk or push):
            blocked.append(name)
    return blocked


class Sokoban(TextEnvironment):
    """Random solvable Sokoban; rules and generation in the module docstring."""

    action_names = ACTION_NAMES
    symbols = SYMBOLS
    symbol_colors = SYMBOL_COLORS

    @property
    def name(self) -> str:
        return "sokoban"

    @property
    def default_params(self) -> SokobanParams:
        return SokobanParams()

    def check_params(self, params: SokobanParams) -> None:
        super().check_params(params)
        reverse, carve = resolved_steps(params)
        if params.dim_room < 4:
            raise ValueError(f"dim_room must be >= 4, got {params.dim_room}")
        if params.num_boxes < 1:
            raise ValueError(f"num_boxes must be >= 1, got {params.num_boxes}")
        if params.num_boxes + 2 > (params.dim_room - 2) ** 2:
            raise ValueError(
                f"num_boxes={params.num_boxes} does not fit a {params.dim_room}x"
                f"{params.dim_room} room (at most {(params.dim_room - 2) ** 2 - 2})"
            )
        if params.revisit_memory < 0:
            raise ValueError(f"revisit_memory must be >= 0, got {params.revisit_memory}")
        if float(params.revisit_penalty) > 0 and params.revisit_memory < 1:
            raise ValueError("revisit_penalty needs revisit_memory >= 1 (how many positions "
                             "to remember; max_turns covers an episode)")
        for name in ("progress_reward", "bump_penalty", "revisit_penalty"):
            if not float(getattr(params, name)) >= 0.0:
                raise ValueError(f"{name} must be >= 0, got {getattr(params, name)}")
        if reverse < 1 or carve < params.num_boxes + 1:
            raise ValueError(
                f"num_reverse_steps must be >= 1 and num_carve_steps >= num_boxes + 1, "
                f"got {reverse} and {carve}"
            )

    def reset_env(self, key, params: SokobanParams):
        state = generate_level(key, params)
        memory = params.revisit_memory
        if memory:
            state = state.replace(
                seen_boxes=jnp.zeros((memory, *state.boxes.shape), bool).at[0].set(state.boxes),
                seen_players=jnp.zeros((memory, 2), jnp.int32).at[0].set(state.player),
                seen_count=jnp.int32(1))
        return self.observe(key, state, None, params), state

    def state_hash(self, state) -> bytes:
        """As `TextEnvironment.state_hash`, without the revisit memory: a position is the
        same anchor state however the episode got there."""
        return super().state_hash(state.replace(seen_boxes=None, seen_players=None,
                                                seen_count=None))

    @staticmethod
    def remember(state: SokobanState, moved: SokobanState, changed):
        """(moved with its position written to the memory when `changed`, whether that
        position was already in it)."""
        memory = state.seen_boxes.shape[0]
        same = (jnp.all(state.seen_boxes == moved.boxes[None], axis=(1, 2))
                & jnp.all(state.seen_players == moved.player[None], axis=1))
        revisit = changed & jnp.any(same & (jnp.arange(memory) < state.seen_count))
        slot = state.seen_count % memory
        written = moved.replace(
            seen_boxes=state.seen_boxes.at[slot].set(moved.boxes),
            seen_players=state.seen_players.at[slot].set(moved.player),
            seen_count=state.seen_count + 1)
        return jax.tree.map(lambda new, old: jnp.where(changed, new, old), written, moved), \
            revisit

    def transition(self, key, state: SokobanState, action, params):
        move = MOVES[action]
        one, two = state.player + move, state.player + 2 * move
        box_ahead = _cell(state.boxes, one, False)
        walk = ~_cell(state.walls, one, True) & ~box_ahead
        push = box_ahead & ~_cell(state.walls, two, True) & ~_cell(state.boxes, two, False)
        rows, cols = state.boxes.shape
        one_c = (jnp.clip(one[0], 0, rows - 1), jnp.clip(one[1], 0, cols - 1))
        two_c = (jnp.clip(two[0], 0, rows - 1), jnp.clip(two[1], 0, cols - 1))
        pushed = state.boxes.at[one_c].set(False).at[two_c].set(True)
        boxes = jnp.where(push, pushed, state.boxes)
        player = jnp.where(walk | push, one, state.player)
        onto = state.targets[two_c].astype(jnp.float32) - state.targets[one_c].astype(jnp.float32)
        solved = ~jnp.any(boxes & ~state.targets)
        reward = STEP_REWARD + push * BOX_ON_TARGET_REWARD * onto + solved * SOLVED_REWARD
        moved = state.replace(boxes=boxes, player=player)
        gain = potential(moved, params.push_potential) - potential(state, params.push_potential)
        reward = (reward + params.progress_reward * gain
                  - params.bump_penalty * ~(walk | push))
        if params.revisit_memory:
            moved, revisit = self.remember(state, moved, walk | push)
            reward = reward - params.revisit_penalty * revisit
        return moved, reward, solved, solved

    def symbol_grid(self, state: SokobanState, params) -> jax.Array:
        grid = jnp.where(state.walls, WALL, jnp.where(state.targets, TARGET, FLOOR))
        grid = jnp.where(state.boxes, jnp.where(state.targets, BOX_ON_TARGET, BOX), grid)
        row, col = state.player[0], state.player[1]
        on_target = state.targets[row, col]
        return grid.at[row, col].set(jnp.where(on_target, PLAYER_ON_TARGET, PLAYER))

    def render_text(self, state: SokobanState, params: SokobanParams) -> str:
        board = super().render_text(state, params)
        boxes, targets = np.asarray(state.boxes), np.asarray(state.targets)
        loose = np.argwhere(boxes & ~targets)
        if not params.hints or len(loose) == 0:  # solved: the game is over
            return board
        player = tuple(int(x) for x in state.player)
        # Nearest box off a target (ties: the first in row-major order), then its nearest
        # target without a box.
        box = min(map(tuple, loose), key=lambda b: abs(b[0] - player[0]) + abs(b[1] - player[1]))
        free = np.argwhere(targets & ~boxes)
        target = min(map(tuple, free), key=lambda t: abs(t[0] - box[0]) + abs(t[1] - box[1]))
        hint = f"Box: {directions(player, box)}. Target: {directions(box, target)}."
        blocked = blocked_moves(np.asarray(state.walls), boxes, player) \
            if params.blocked_hints else []
        if blocked:
            hint += f" Blocked: {' '.join(blocked)}."
        return f"{board}\n{hint}"

    def instructions(self, params: SokobanParams) -> str:
        if params.brief_instructions:
            return ("Push the box X onto the target O; you are P, # is a wall. "
                    f"Reply <answer>ACTION</answer>, ACTION one of {', '.join(self.action_names)}.")
        rules = (
            "You are playing Sokoban in a room seen from above, top row first. Push every box "
            "onto a target. You can push a box by walking into it if the cell behind it is "
            "free, but you cannot pull boxes, and walls block you. Rewards: -0.1 per step, "
            "+1 for pushing a box onto a target, -1 for pushing one off, +10 when all boxes "
            "are on targets, which ends the game."
        )
        legend = {
            "#": "wall",
            "_": "floor",
            "O": "target",
            "X": "box",
            "√": "box on a target",
            "P": "you",
            "S": "you, standing on a target",
        }
        return format_instructions(rules, legend, self.action_names)
