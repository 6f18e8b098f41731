"""Any discrete-action environment of gymnax's own registry, played through text.

`make("gymnax:<id>")` wraps `gymnax.make(id)`. The text shows the observation array
(shape, values rounded to 2 decimals); actions are named `"0".."n-1"`, or by the friendlier
names below where the meaning of the ids is known. The invalid-action rule, the format
penalty and the info keys are those of every `TextEnvironment`; here an action is effective
when the observation changed, and a step counts as a success when it terminates the episode
with a positive reward (gymnax has no notion of success, so this is a heuristic).

The wrapper counts its own `time` (invalid replies advance it too) and truncates at its
`max_steps_in_episode`, which defaults to the wrapped environment's own limit.
"""

from typing import Any

import gymnax
import jax
import jax.numpy as jnp
import numpy as np
from flax import struct
from gymnax.environments import spaces

from jaxrl_agentic.envs.base import (
    TextEnvironment,
    TextEnvParams,
    check_param_names,
    format_instructions,
    hash_pytree,
    trees_equal,
)

PREFIX = "gymnax:"

# Action names where the gymnax ids have a known meaning (from each environment's source).
FRIENDLY_ACTION_NAMES = {
    "CartPole-v1": ("Left", "Right"),
    "Catch-bsuite": ("Left", "Stay", "Right"),
    "FrozenLake-misc": ("Left", "Down", "Right", "Up"),
    "FourRooms-misc": ("Up", "Right", "Down", "Left"),
    "MountainCar-v0": ("Left", "Stay", "Right"),
    "Breakout-MinAtar": ("Stay", "Left", "Right"),
}
_DECIMALS = 2
_HEATMAP_CELL_PIXELS = 8


@struct.dataclass
class GymnaxTextState:
    inner: Any  # the wrapped environment's state
    obs: Any  # its latest observation (what the text shows)
    time: jax.Array


@struct.dataclass
class GymnaxTextParams(TextEnvParams):
    """inner: the wrapped environment's params (its fields can be set through `make` too)."""

    inner: Any = None


def format_number(value) -> str:
    """A number rounded to 2 decimals without trailing zeros: 1, 0.05, -2.5."""
    if isinstance(value, bool | np.bool_):
        return str(int(value))
    text = np.format_float_positional(round(float(value), _DECIMALS), trim="-")
    return "0" if text == "-0" else text


def format_array(array: np.ndarray) -> str:
    """Text of an array: a scalar, one row, rows of a matrix, or 2-D slices of a tensor.

    A tensor is shown as its [:, :, k...] slices: gymnax images (MinAtar) are channels-last,
    so each slice is one channel's map.
    """
    if array.ndim == 0:
        return format_number(array.item())
    if array.ndim == 1:
        return " ".join(format_number(x) for x in array)
    if array.ndim == 2:
        return "\n".join(format_array(row) for row in array)
    blocks = []
    for index in np.ndindex(*array.shape[2:]):
        header = "[:, :, " + ", ".join(map(str, index)) + "]"
        blocks.append(f"{header}\n{format_array(array[(slice(None), slice(None), *index)])}")
    return "\n".join(blocks)


class GymnaxTextAdapter(TextEnvironment):
    """A discrete-action gymnax environment behind the text protocol (module doc)."""

    def __init__(self, env_id: str):
        if env_id not in gymnax.registered_envs:
            raise ValueError(
                f"unknown gymnax environment {env_id!r}; gymnax has: "
                f"{', '.join(gymnax.registered_envs)}"
            )
        inner, inner_params = gymnax.make(env_id)
        space = inner.action_space(inner_params)
        if not isinstance(space, spaces.Discrete):
            raise ValueError(
                f"{PREFIX}{env_id} has a {type(space).__name__} action space; only "
                "Discrete action spaces can be chosen by name in a text reply"
            )
        self.env_id = env_id
        self.inner = inner
        self._inner_default_params = inner_params
        friendly = FRIENDLY_ACTION_NAMES.get(env_id)
        self.action_names = (
            friendly if friendly is not None else tuple(str(i) for i in range(space.n))
        )

    @property
    def name(self) -> str:
        return PREFIX + self.env_id

    @property
    def default_params(self) -> GymnaxTextParams:
        inner = self._inner_default_params
        return GymnaxTextParams(
            inner=inner, max_steps_in_episode=int(inner.max_steps_in_episode)
        )

    def replace_params(self, params: GymnaxTextParams, **overrides) -> GymnaxTextParams:
        """Like the base, but names that are fields of the wrapped params go to `inner`."""
        check_param_names(self.name, overrides, self.allowed_params(params))
        own = {k: v for k, v in overrides.items() if k in _field_names(params)}
        rest = {k: v for k, v in overrides.items() if k not in own}
        return params.replace(**own, inner=params.inner.replace(**rest))

    def allowed_params(self, params: GymnaxTextParams) -> list[str]:
        names = [n for n in _field_names(params) if n != "inner"]
        return names + [n for n in _field_names(params.inner) if n not in names]

    def reset_env(self, key, params: GymnaxTextParams):
        obs, inner_state = self.inner.reset_env(key, params.inner)
        state = GymnaxTextState(inner=inner_state, obs=obs, time=jnp.int32(0))
        return obs, state

    def transition(self, key, state: GymnaxTextState, action, params: GymnaxTextParams):
        obs, inner_state, reward, terminated, _ = self.inner.step_env(
            key, state.inner, action, params.inner
        )
        # Keep the reset dtypes so gymnax's auto-reset `select` sees matching leaves.
        obs = jax.tree.map(lambda new, old: jnp.asarray(new).astype(old.dtype), obs, state.obs)
        reward = jnp.asarray(reward, jnp.float32)
        success = jnp.asarray(terminated, bool) & (reward > 0)
        return state.replace(inner=inner_state, obs=obs), reward, terminated, success

    def same_situation(self, state: GymnaxTextState, other: GymnaxTextState) -> jax.Array:
        return trees_equal(state.obs, other.obs)

    def observe(self, key, state: GymnaxTextState, action, params):
        return state.obs

    def instructions(self, params: GymnaxTextParams) -> str:
        rules = (
            f"You control the environment {self.env_id} from gymnax. Each turn you see its "
            "observation as numbers (rounded to 2 decimals; the array shape is given). "
            "Choose actions that maximise the total reward."
        )
        return format_instructions(rules, {}, self.action_names)

    def render_text(self, state: GymnaxTextState, params) -> str:
        """Each observation leaf as `Observation (shape S):` followed by its values."""
        leaves = jax.tree_util.tree_flatten_with_path(state.obs)[0]
        parts = []
        for path, leaf in leaves:
            array = np.asarray(leaf)
            label = "Observation" + jax.tree_util.keystr(path)
            parts.append(f"{label} (shape {array.shape}):\n{format_array(array)}")
        return "\n".join(parts)

    def render_rgb(self, state: GymnaxTextState, params) -> np.ndarray:
        """Grey heat map of the observation (min black, max white), 8 px per value.

        Leaves are flattened to 2-D (a vector is one row, trailing axes are joined) and
        stacked vertically.
        """
        rows = []
        for leaf in jax.tree.leaves(state.obs):
            array = np.asarray(leaf, np.float64)
            rows.append(array.reshape(array.shape[0] if array.ndim >= 2 else 1, -1))
        width = max(r.shape[1] for r in rows)
        grid = np.concatenate([np.pad(r, ((0, 0), (0, width - r.shape[1]))) for r in rows])
        low, high = grid.min(), grid.max()
        scaled = (grid - low) / (high - low) if high > low else np.zeros_like(grid)
        grey = (scaled * 255).round().astype(np.uint8)
        image = np.repeat(grey[..., None], 3, axis=-1)
        return image.repeat(_HEATMAP_CELL_PIXELS, axis=0).repeat(_HEATMAP_CELL_PIXELS, axis=1)

    def state_hash(self, state: GymnaxTextState) -> bytes:
        """Hash of the wrapped state and observation, both clocks left out (see base)."""
        inner = state.inner
        if hasattr(inner, "time"):
            inner = inner.replace(time=0)
        return hash_pytree((inner, state.obs))


def _field_names(params) -> list[str]:
    return list(getattr(params, "__dataclass_fields__", {}))
