"""Python (host-side) environments: the JAX adapter's keys and messages, and the registry."""

import jax
import numpy as np
import pytest

from jaxrl_agentic.envs import INVALID_ACTION, make
from jaxrl_agentic.envs.messages import feedback_message, first_message
from jaxrl_agentic.envs.python_env import (
    JaxEnvAsPython,
    PyStep,
    PythonTextEnv,
    make_python_env,
    register_python_env,
    registered_python_envs,
    text_state_hash,
)
from jaxrl_agentic.rollout.groups import EpisodeSpec


def test_adapter_plays_the_jax_env_with_the_rollout_keys():
    """Same map for a group, member noise on a slippery lake, same messages and flags."""
    env, params = make("frozen_lake_slippery")
    factory = make_python_env("frozen_lake_slippery")
    run_seed, seed, member = 3, 8, 1
    py = factory(EpisodeSpec(seed=seed, group_id=0, member=member), run_seed)
    assert isinstance(py, JaxEnvAsPython) and py.max_steps_in_episode == 100

    map_key = jax.random.fold_in(jax.random.PRNGKey(run_seed), seed)
    noise_key = jax.random.fold_in(map_key, 1 + member)
    _, state = env.reset_env(map_key, params)
    assert py.reset(seed) == first_message(env, state, params)
    replies = ["<answer>Down</answer>", "no action", "<answer>Right</answer>",
               "<answer>Right</answer>"]
    steps = []
    for t, reply in enumerate(replies):
        assert py.state_hash() == env.state_hash(state)
        action = env.parse_action(reply)
        action = INVALID_ACTION if action is None else action
        _, state, reward, terminated, info = env.step_env(
            jax.random.fold_in(noise_key, t), state, action, params)
        step = py.step(reply)
        assert step == PyStep(
            observation=feedback_message(env, state, params, float(reward), action),
            reward=float(reward), terminated=bool(terminated),
            action_is_valid=bool(info["action_is_valid"]),
            action_is_effective=bool(info["action_is_effective"]),
            success=bool(info["success"]), action=action)
        steps.append(step)
        if step.terminated:
            break
    assert len(steps) >= 2 and not steps[1].action_is_valid  # an invalid reply was played
    members = [factory(EpisodeSpec(seed=seed, group_id=0, member=m), run_seed) for m in (0, 1)]
    assert members[0].reset(seed) == members[1].reset(seed)  # a group shares the map


def test_registry_names_and_one_line_errors():
    names = registered_python_envs()
    assert {"frozen_lake", "sokoban"} <= set(names)
    factory = make_python_env("sokoban", dim_room=6, step_delay_s=0.0, format_penalty=0.2)
    env = factory(EpisodeSpec(seed=0, group_id=0, member=0), 0)
    assert env.params.format_penalty == pytest.approx(0.2)
    with pytest.raises(ValueError, match=r"unknown python environment 'nope'; registered: .*"
                                         r"frozen_lake.*sokoban") as err:
        make_python_env("nope")
    assert "\n" not in str(err.value)
    with pytest.raises(ValueError, match=r"frozen_lake: unknown parameter 'sizee'") as err:
        make_python_env("frozen_lake", sizee=3)
    assert "\n" not in str(err.value)
    with pytest.raises(ValueError, match="step_delay_s must be >= 0"):
        make_python_env("frozen_lake", step_delay_s=-1)
    with pytest.raises(ValueError, match="hang_on_step must be an int"):
        make_python_env("frozen_lake", hang_on_step=0.5)
    with pytest.raises(ValueError, match="already registered"):
        register_python_env("frozen_lake", lambda **config: None)
    with pytest.raises(TypeError, match="must be callable"):
        register_python_env("some_tool", 3)


class _Echo(PythonTextEnv):
    max_steps_in_episode = 2

    def reset(self, seed):
        self.seen = [str(seed)]
        return "say something"

    def step(self, reply):
        self.seen.append(reply)
        return PyStep(observation=f"you said {reply!r}", reward=1.0, terminated=False,
                      action_is_valid=True, action_is_effective=True, success=False)

    def state_hash(self):
        return text_state_hash("|".join(self.seen))


def test_register_a_python_env_and_stable_state_hash():
    register_python_env("echo_for_test", lambda **config: lambda spec, run_seed: _Echo())
    env = make_python_env("echo_for_test")(EpisodeSpec(seed=4, group_id=0, member=0), 0)
    assert env.reset(4) == "say something"
    first = env.state_hash()
    step = env.step("hi")
    assert step.action == INVALID_ACTION and step.reward == 1.0
    assert env.state_hash() != first
    # blake2b, not Python's salted hash(): the same in every process
    assert text_state_hash("abc").hex() == "cf4ab791c62b8d2b2109c90275287816"
    assert len(text_state_hash("")) == 16
    with pytest.raises(NotImplementedError, match="must implement step"):
        PythonTextEnv().step("x")


def test_adapter_step_delay_and_uncompiled_use():
    env, params = make("frozen_lake")
    py = JaxEnvAsPython(env, params, member=0, run_seed=0, step_delay_s=0.01)
    with pytest.raises(RuntimeError, match="before reset"):
        py.step("<answer>Up</answer>")
    py.reset(2)
    step = py.step("<answer>Up</answer>")
    assert step.action == 3 and isinstance(step.reward, float)
    assert np.isfinite(step.reward)


def test_the_adapter_warms_up_with_random_valid_actions():
    """`warmup_reply` of a JAX environment played through the Python backend: a uniformly
    random valid action in the JAX warm-up's form; a plain Python env has none (None)."""
    import random

    from jaxrl_agentic.envs.python_env import PythonTextEnv

    env = make_python_env("frozen_lake")(EpisodeSpec(seed=0, group_id=0, member=0), 0)
    env.reset(0)
    rng = random.Random(0)
    replies = {env.warmup_reply(rng) for _ in range(200)}
    assert replies == {f"<answer>{name}</answer>" for name in ("Left", "Down", "Right", "Up")}
    assert PythonTextEnv.warmup_reply is None
