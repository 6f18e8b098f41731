"""The text protocol shared by all environments: invalid actions, rendering, state hashing.

A `TextEnvironment` is a gymnax `Environment` (pure, jittable `reset_env`/`step_env`, state
as a `flax.struct.dataclass`, params separate from state) plus what a language-model rollout
needs on the host: instructions, a text rendering of the state, a reply parser, a small RGB
image and a hash of the state.

Subclasses implement `transition` (the dynamics for a *valid* action) instead of
`step_env`; the base `step_env` handles the action `INVALID_ACTION` (-1) that the rollout
passes when a reply held no valid action:

    state' = state (only `time` advances, so `max_steps_in_episode` truncation still works)
    reward = -params.format_penalty,  terminated = False

and it adds to `info`: `action_is_valid`, `action_is_effective` (the state changed, `time`
aside) and `success` (the episode was solved by this step).
"""

import hashlib
from collections.abc import Callable
from functools import partial
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from flax import struct
from gymnax.environments import environment, spaces

from jaxrl_agentic.envs.parsing import parse_action

INVALID_ACTION = -1


@struct.dataclass
class TextEnvParams(environment.EnvParams):
    """Fields every text environment has.

    max_steps_in_episode: the episode is truncated once this many steps (valid or not) ran.
    format_penalty: a reply without a valid action costs this much (reward = -format_penalty).
    cell_separator: text between the cells of a rendered grid row. "" is the usual compact
        board (`__OP`); " " (`_ _ O P`) makes every cell its own token under byte-level BPE
        tokenizers, which otherwise merge runs such as `____` or `OP` into tokens whose
        meaning depends on the neighbours, so a small model can hardly tell where it is.
    """

    max_steps_in_episode: int = 100
    format_penalty: float = 0.1
    cell_separator: str = struct.field(pytree_node=False, default="")


def format_instructions(
    rules: str, legend: dict[str, str], action_names: tuple[str, ...]
) -> str:
    """Instruction text in the layout every environment uses: rules, legend, actions, format.

    `legend` maps each symbol of the rendering to its meaning; an empty one is left out.
    """
    legend_lines = "".join(f"  {symbol}: {meaning}\n" for symbol, meaning in legend.items())
    symbols = f"Symbols:\n{legend_lines}" if legend else ""
    example = action_names[0]
    return (
        f"{rules}\n"
        f"{symbols}"
        f"Actions: {', '.join(action_names)}\n"
        "Think if you like, then give exactly one action per turn in the form "
        f"<answer>ACTION</answer>, for example <answer>{example}</answer>."
    )


def check_param_names(env_name: str, names, allowed: list[str]) -> None:
    """Raise a one-line ValueError naming the first of `names` not in `allowed`."""
    for name in names:
        if name not in allowed:
            raise ValueError(
                f"{env_name}: unknown parameter {name!r}; allowed: {', '.join(allowed)}"
            )


def tree_where(condition: jax.Array, on_true: Any, on_false: Any) -> Any:
    """Leaf-wise `jnp.where` over two pytrees of the same structure."""
    return jax.tree.map(lambda a, b: jnp.where(condition, a, b), on_true, on_false)


def trees_equal(a: Any, b: Any) -> jax.Array:
    """Scalar bool: every leaf of `a` equals the matching leaf of `b`."""
    leaves = jax.tree.leaves(jax.tree.map(lambda x, y: jnp.all(x == y), a, b))
    return jnp.all(jnp.stack(leaves)) if leaves else jnp.bool_(True)


def sample_until(key: jax.Array, draw: Callable[[jax.Array], tuple[Any, jax.Array]]) -> Any:
    """First sample of `draw(key_i) -> (sample, acceptable)` that is acceptable.

    key_i = fold_in(key, i) for attempts i = 0, 1, ... in a `lax.while_loop`, so rejection
    sampling stays jittable and vmappable (under vmap the loop runs until every element is
    accepted). `draw` is traced once: the loop starts from a zero sample marked unacceptable.
    """

    def attempt(carry):
        i, _, _ = carry
        sample, acceptable = draw(jax.random.fold_in(key, i))
        return i + 1, sample, jnp.asarray(acceptable, bool)

    shapes = jax.eval_shape(draw, key)[0]
    empty = jax.tree.map(lambda s: jnp.zeros(s.shape, s.dtype), shapes)
    _, sample, _ = jax.lax.while_loop(
        lambda carry: ~carry[2], attempt, (jnp.int32(0), empty, jnp.bool_(False))
    )
    return sample


def uniform_ints(bits: jax.Array, n: int) -> jax.Array:
    """int32 in [0, n) from uint32 random bits (modulo bias < n / 2**32: negligible here)."""
    return (bits % jnp.uint32(n)).astype(jnp.int32)


def hash_pytree(tree: Any) -> bytes:
    """16-byte digest of a pytree's structure, leaf dtypes, shapes and values (host-side)."""
    digest = hashlib.blake2b(digest_size=16)
    leaves, treedef = jax.tree_util.tree_flatten(tree)
    digest.update(str(treedef).encode())
    for leaf in leaves:
        array = np.ascontiguousarray(np.asarray(leaf))
        digest.update(f"{array.dtype.str}{array.shape}".encode())
        digest.update(array.tobytes())
    return digest.digest()


class TextEnvironment(environment.Environment):
    """Base class: a gymnax environment that a language model plays through text.

    Class attributes a subclass sets:
      action_names: reply names of the actions, index = action id.
      symbols: for grid environments, the character of each cell code in `symbol_grid`.
      symbol_colors: the RGB colour of each cell code, for `render_rgb`.
    Methods a subclass implements: `default_params`, `reset_env`, `transition`,
    `instructions`, and either `symbol_grid` (grid environments get `observe`,
    `render_text` and `render_rgb` from it) or those three methods themselves.
    """

    action_names: tuple[str, ...] = ()
    symbols: tuple[str, ...] = ()
    symbol_colors: tuple[tuple[int, int, int], ...] = ()
    cell_pixels: int = 16

    # ---- gymnax API -------------------------------------------------------------------

    @property
    def default_params(self) -> TextEnvParams:
        return TextEnvParams()

    @property
    def num_actions(self) -> int:
        return len(self.action_names)

    def action_space(self, params: TextEnvParams | None = None) -> spaces.Discrete:
        return spaces.Discrete(self.num_actions)

    def step_env(self, key, state, action, params):
        """One step; `INVALID_ACTION` (or any id out of range) keeps the state, see module doc."""
        action = jnp.asarray(action, jnp.int32)
        is_valid = (action >= 0) & (action < self.num_actions)
        # Both branches are computed (under vmap a `lax.cond` would run both anyway).
        moved, reward, terminated, success = self.transition(
            key, state, jnp.where(is_valid, action, 0), params
        )
        next_state = tree_where(is_valid, moved, state).replace(time=state.time + 1)
        info = {
            "action_is_valid": is_valid,
            "action_is_effective": is_valid & ~self.same_situation(state, next_state),
            "success": is_valid & jnp.asarray(success, bool),
        }
        reward = jnp.where(is_valid, reward, -jnp.asarray(params.format_penalty))
        terminated = is_valid & jnp.asarray(terminated, bool)
        obs = self.observe(key, next_state, action, params)
        return obs, next_state, reward.astype(jnp.float32), terminated, info

    def transition(self, key, state, action, params):
        """Dynamics for a valid action id -> (next_state, reward, terminated, success).

        `next_state.time` is set by the caller, so a subclass leaves it alone.
        """
        raise NotImplementedError(f"{self.name} must implement transition()")

    def same_situation(self, state, other) -> jax.Array:
        """Whether two states are the same apart from `time` (the action had no effect)."""
        return trees_equal(state.replace(time=0), other.replace(time=0))

    def observe(self, key, state, action, params):
        del key, action
        return self.symbol_grid(state, params)

    # ---- text protocol ----------------------------------------------------------------

    def symbol_grid(self, state, params) -> jax.Array:
        """int32 [rows, cols] of cell codes indexing `symbols` / `symbol_colors`."""
        raise NotImplementedError(f"{self.name} must implement symbol_grid() or render_*()")

    def instructions(self, params: TextEnvParams) -> str:
        """Rules, symbol legend, available actions and the reply format, for the prompt."""
        raise NotImplementedError(f"{self.name} must implement instructions()")

    def parse_action(self, reply: str) -> int | None:
        """Action id named by the last `<answer>…</answer>` in `reply`, or None."""
        return parse_action(reply, self.action_names)

    def allowed_params(self, params: TextEnvParams) -> list[str]:
        """Names `make` accepts as keyword overrides: the fields of the params dataclass."""
        return list(params.__dataclass_fields__)

    def replace_params(self, params: TextEnvParams, **overrides) -> TextEnvParams:
        """`params` with fields replaced; an unknown name raises a one-line ValueError."""
        check_param_names(self.name, overrides, self.allowed_params(params))
        return params.replace(**overrides)

    def check_params(self, params: TextEnvParams) -> None:
        """Raise ValueError for params this environment cannot run with (called by `make`)."""
        if not isinstance(params.cell_separator, str) or "\n" in params.cell_separator:
            raise ValueError(f"cell_separator must be a one-line string, got "
                             f"{params.cell_separator!r}")
        if not float(params.format_penalty) >= 0.0:
            raise ValueError(f"format_penalty must be >= 0, got {params.format_penalty}")
        if int(params.max_steps_in_episode) < 1:
            raise ValueError(
                f"max_steps_in_episode must be >= 1, got {params.max_steps_in_episode}"
            )

    @partial(jax.jit, static_argnames=("self",))
    def _host_symbol_grid(self, state, params):
        # Jitted so host-side rendering costs one dispatch, not one per jnp op.
        return self.symbol_grid(state, params)

    def render_text(self, state, params: TextEnvParams) -> str:
        """One line per grid row, one symbol per cell, cells joined by `params.cell_separator`
        (single, un-batched state)."""
        grid = np.asarray(self._host_symbol_grid(state, params))
        sep = params.cell_separator
        return "\n".join(sep.join(self.symbols[code] for code in row) for row in grid)

    def render_rgb(self, state, params: TextEnvParams) -> np.ndarray:
        """uint8 [rows*cell_pixels, cols*cell_pixels, 3]: each cell filled with its colour."""
        grid = np.asarray(self._host_symbol_grid(state, params))
        image = np.asarray(self.symbol_colors, np.uint8)[grid]
        return image.repeat(self.cell_pixels, axis=0).repeat(self.cell_pixels, axis=1)

    def state_hash(self, state) -> bytes:
        """Bytes equal exactly when two states are equal, `time` aside (host-side).

        Used for GiGPO anchor-state groups. `time` is left out: the agent never sees the
        clock, so a situation revisited on a later turn (or kept by an invalid reply) is the
        same anchor state.
        """
        return hash_pytree(state.replace(time=0))
