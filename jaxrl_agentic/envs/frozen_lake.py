"""FrozenLake with a fresh random map every episode, every map solvable.

Rules: the player walks on a square lake of frozen tiles and holes towards the goal.
Reaching the goal gives reward 1 and ends the episode; falling into a hole ends it with 0;
every other step gives 0. A move off the edge leaves the player in place (valid, not
effective). On a slippery lake the player moves in the intended direction with probability
1/3 and in each of the two perpendicular directions with probability 1/3 (gym's rule).

Maps: each tile is frozen with probability `p_frozen`, else a hole; start and goal are two
distinct uniform cells (the start tile is frozen). A map whose goal cannot be reached from
the start through non-hole tiles is redrawn, inside JAX, until one can (a flood fill
decides). Unlike gymnax's `FrozenLake-misc`, whose map is fixed in the constructor, the map
lives in the state.
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

# Tile codes in `FrozenLakeState.grid`.
FROZEN, HOLE, GOAL = 0, 1, 2
# Symbol codes: a tile code, or 3 + the tile code for the cell the player stands on.
SYMBOLS = ("_", "O", "G", "P", "X", "√")
SYMBOL_COLORS = (
    (200, 230, 255),  # frozen: pale ice
    (20, 40, 90),  # hole: dark water
    (40, 180, 60),  # goal: green
    (230, 60, 50),  # player: red
    (120, 40, 140),  # player in a hole: purple
    (250, 200, 30),  # player on the goal: gold
)
ACTION_NAMES = ("Left", "Down", "Right", "Up")
# (row, col) step per action; consecutive actions are perpendicular, so action +-1 (mod 4)
# are the two directions a slippery lake can deflect into.
HOST_MOVES = np.array([[0, -1], [1, 0], [0, 1], [-1, 0]], np.int32)  # for host-side text
MOVES = jnp.asarray(HOST_MOVES)
# How `hints` name a tile.
TILE_WORDS = {FROZEN: "ice", HOLE: "hole", GOAL: "goal"}
HINT_STYLES = ("full", "short")


@struct.dataclass
class FrozenLakeState:
    grid: jax.Array  # int32 [size, size] tile codes
    position: jax.Array  # int32 [2] player (row, col)
    time: jax.Array


@struct.dataclass
class FrozenLakeParams(TextEnvParams):
    """size: side of the square map (static: it sets array shapes).
    p_frozen: probability that a tile (other than start and goal) is frozen.
    is_slippery: deflect moves as described in the module doc.

    hints: after the board, spell out where the goal is and what the four neighbouring
        tiles are ("Goal: 2 Down, 1 Left. Next to you: Left hole, Down ice, Right edge,
        Up ice."). Optional help for small models, which find it hard to locate two symbols
        in a token grid; the rules, rewards and maps are unchanged.
    hint_style: "full" (above) or "short": only the directions towards the goal, and the
        neighbouring holes in lower case ("Goal: Down Left. Holes: left."). In the short
        form each fact a move depends on is a token of its own (" Down" = towards the goal,
        " l"+"eft" = a hole on the left), so a model can read it before it has learned
        where on the line to look; in the full form every direction name appears in every
        hint. A from-scratch tiny model learns the oracle move from the short form in ~100
        supervised updates and has not started to after 150 from the full one.
    progress_reward: shaping, reward += progress_reward · (d_before − d_after) per step,
        d = Manhattan distance from the player to the goal (0 = the usual sparse reward).
        Success is still only reaching the goal.
    hole_penalty: reward −= hole_penalty when the player falls into a hole (0 = the usual
        reward). With progress shaping alone a step into a hole towards the goal would pay.
    brief_instructions: a two-line instruction text (~30 tokens instead of ~250): a small
        model trained from scratch reads no English, and every prompt token it must attend
        past dilutes the board.
    """

    size: int = struct.field(pytree_node=False, default=4)
    p_frozen: float = 0.8
    is_slippery: bool = False
    hints: bool = struct.field(pytree_node=False, default=False)
    hint_style: str = struct.field(pytree_node=False, default="full")
    progress_reward: float = 0.0
    hole_penalty: float = 0.0
    bump_penalty: float = 0.0
    brief_instructions: bool = struct.field(pytree_node=False, default=False)


def reachable_cells(passable: jax.Array, start: jax.Array) -> jax.Array:
    """bool grid of cells reachable from `start` (row, col) by 4-neighbour steps on `passable`."""
    seed = jnp.zeros_like(passable).at[start[0], start[1]].set(True) & passable

    def grow(carry):
        reach, _ = carry
        padded = jnp.pad(reach, 1)
        neighbours = (
            padded[:-2, 1:-1] | padded[2:, 1:-1] | padded[1:-1, :-2] | padded[1:-1, 2:]
        )
        grown = (reach | neighbours) & passable
        return grown, jnp.any(grown != reach)

    reach, _ = jax.lax.while_loop(lambda carry: carry[1], grow, (seed, jnp.bool_(True)))
    return reach


def draw_map(key: jax.Array, size: int, p_frozen: jax.Array):
    """One candidate ((grid, start), solvable): a random map and whether its goal is reachable."""
    cells = size * size
    # One draw of random bits for the whole map: each separate jax.random call adds its own
    # threefry computation to the compiled program, and compile time is what dominates here.
    bits = jax.random.bits(key, (cells + 2,), jnp.uint32)
    frozen = (bits[:cells] >> 8).astype(jnp.float32) / 2.0**24 < p_frozen
    start = uniform_ints(bits[cells], cells)
    goal = uniform_ints(bits[cells + 1], cells - 1)
    goal = goal + (goal >= start)  # uniform over the cells other than start
    grid = jnp.where(frozen, FROZEN, HOLE).at[start].set(FROZEN).at[goal].set(GOAL)
    grid = grid.reshape(size, size).astype(jnp.int32)
    start_rc = jnp.stack(jnp.divmod(start, size)).astype(jnp.int32)
    solvable = reachable_cells(grid != HOLE, start_rc)[goal // size, goal % size]
    return (grid, start_rc), solvable


class FrozenLake(TextEnvironment):
    """Random solvable FrozenLake; rules in the module docstring."""

    action_names = ACTION_NAMES
    symbols = SYMBOLS
    symbol_colors = SYMBOL_COLORS

    @property
    def name(self) -> str:
        return "frozen_lake"

    @property
    def default_params(self) -> FrozenLakeParams:
        return FrozenLakeParams()

    def check_params(self, params: FrozenLakeParams) -> None:
        super().check_params(params)
        if params.size < 2:
            raise ValueError(f"size must be >= 2 (start and goal differ), got {params.size}")
        if not 0.0 < float(params.p_frozen) <= 1.0:
            raise ValueError(f"p_frozen must be in (0, 1], got {params.p_frozen}")
        for name in ("hole_penalty", "bump_penalty"):
            if not float(getattr(params, name)) >= 0.0:
                raise ValueError(f"{name} must be >= 0, got {getattr(params, name)}")
        if params.hint_style not in HINT_STYLES:
            raise ValueError(f"hint_style must be one of {HINT_STYLES}, got {params.hint_style!r}")

    def reset_env(self, key, params: FrozenLakeParams):
        grid, start = sample_until(key, lambda k: draw_map(k, params.size, params.p_frozen))
        state = FrozenLakeState(grid=grid, position=start, time=jnp.int32(0))
        return self.observe(key, state, None, params), state

    def transition(self, key, state: FrozenLakeState, action, params: FrozenLakeParams):
        deflection = jax.random.randint(key, (), -1, 2)  # -1, 0, +1 with probability 1/3 each
        direction = jnp.where(params.is_slippery, (action + deflection) % 4, action)
        last = state.grid.shape[0] - 1
        position = jnp.clip(state.position + MOVES[direction], 0, last)
        tile = state.grid[position[0], position[1]]
        at_goal = tile == GOAL
        goal = jnp.argwhere(state.grid == GOAL, size=1)[0]
        progress = (jnp.abs(state.position - goal).sum() - jnp.abs(position - goal).sum())
        bumped = jnp.all(position == state.position)
        reward = (at_goal.astype(jnp.float32) + params.progress_reward * progress
                  - params.hole_penalty * (tile == HOLE) - params.bump_penalty * bumped)
        terminated = at_goal | (tile == HOLE)
        return state.replace(position=position), reward, terminated, at_goal

    def symbol_grid(self, state: FrozenLakeState, params) -> jax.Array:
        row, col = state.position[0], state.position[1]
        return state.grid.at[row, col].add(3)

    def render_text(self, state: FrozenLakeState, params: FrozenLakeParams) -> str:
        board = super().render_text(state, params)
        if not params.hints:
            return board
        grid, (row, col) = np.asarray(state.grid), (int(p) for p in state.position)
        if grid[row, col] != FROZEN:  # in a hole or on the goal: the game is over
            return board
        goal_row, goal_col = (int(x) for x in np.argwhere(grid == GOAL)[0])
        steps = [(abs(goal_row - row), "Down" if goal_row > row else "Up"),
                 (abs(goal_col - col), "Right" if goal_col > col else "Left")]
        steps = [(n, name) for n, name in steps if n]
        around = []
        for name, (dr, dc) in zip(self.action_names, HOST_MOVES, strict=True):
            r, c = row + dr, col + dc
            inside = 0 <= r < grid.shape[0] and 0 <= c < grid.shape[1]
            around.append((name, TILE_WORDS[int(grid[r, c])] if inside else "edge"))
        if params.hint_style == "short":
            hint = f"Goal: {' '.join(name for _, name in steps)}."
            holes = [name.lower() for name, tile in around if tile == "hole"]
            return f"{board}\n{hint}" + (f" Holes: {' '.join(holes)}." if holes else "")
        offsets = ", ".join(f"{n} {name}" for n, name in steps)
        neighbours = ", ".join(f"{name} {tile}" for name, tile in around)
        return f"{board}\nGoal: {offsets}. Next to you: {neighbours}."

    def instructions(self, params: FrozenLakeParams) -> str:
        if params.brief_instructions:
            return ("Walk P to the goal G; a hole O ends the game. "
                    f"Reply <answer>ACTION</answer>, ACTION one of {', '.join(self.action_names)}.")
        slippery = (
            "The ice is slippery: you move in the chosen direction only 1/3 of the time, "
            "otherwise to one of its two sides."
            if params.is_slippery
            else "The ice is not slippery: you move exactly where you choose."
        )
        rules = (
            "You are on a frozen lake. Walk to the goal G without falling into a hole O. "
            "Reaching the goal gives reward 1 and ends the game; falling into a hole ends it "
            "with reward 0. Walking off the edge leaves you where you are. "
            f"{slippery} The map is shown as rows of symbols, top row first."
        )
        legend = {
            "P": "you",
            "_": "frozen ice (safe)",
            "O": "hole",
            "G": "goal",
            "X": "you fell into a hole",
            "√": "you are on the goal",
        }
        return format_instructions(rules, legend, self.action_names)
