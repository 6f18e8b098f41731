"""`lookup`: the generated world, the tools, the oracle on 256 seeds."""

import random

import pytest

from jaxrl_agentic.envs.lookup import LookupOracle, get_record, make_world, search_world
from jaxrl_agentic.envs.python_env import make_python_env
from jaxrl_agentic.envs.tools import CALL_CLOSE, CALL_OPEN
from jaxrl_agentic.rollout.groups import EpisodeSpec
from tests.envs.test_calculator import play


def test_oracle_solves_256_seeds_in_two_hops():
    factory = make_python_env("lookup")
    for seed in range(256):
        env = factory(EpisodeSpec(seed=seed, group_id=0, member=0), 0)
        last, steps = play(env, LookupOracle().reply, seed)
        assert last.success, (seed, env.question)
        gets = sum(s.tool_calls for s in steps) - 1  # one search, then gets
        assert gets >= 2 and sum(s.tool_errors for s in steps) == 0
        assert str(env.answer) not in env.question  # the answer is never in the question


def test_world_is_consistent():
    world = make_world(random.Random(3))
    names = [r["name"] for r in world.values()]
    assert len(set(names)) == len(names)
    for key, record in world.items():
        if key.startswith("person/"):
            assert record["lives in"] in world
        else:
            assert world[record["mayor"]]["name"]
    person = next(k for k in world if k.startswith("person/"))
    assert f"{person}: {world[person]['name']}" in search_world(world, world[person]["name"])
    assert search_world(world, "zzzz") == "No results."
    assert get_record(world, person).splitlines()[0] == f"name: {world[person]['name']}"
    with pytest.raises(ValueError, match="no record"):
        get_record(world, "person/999")


def test_a_get_of_a_missing_key_is_a_counted_penalised_error():
    env = make_python_env("lookup", tool_error_penalty=0.2)(EpisodeSpec(0, 0, 0), 0)
    env.reset(0)
    step = env.step(f'{CALL_OPEN}{{"name": "get", "arguments": {{"key": "city/99"}}}}'
                    f'{CALL_CLOSE}{CALL_OPEN}{{"name": "search", "arguments": {{}}}}{CALL_CLOSE}')
    assert (step.tool_calls, step.tool_errors) == (2, 2) and abs(step.reward + 0.4) < 1e-12
    assert all(m.startswith("Error:") for m in step.tool_messages)
