"""`openai_agent`'s env_config: the agent and task sources it takes, their one-line errors,
an agent program's reward read from its output, and batch totals of the agent counts."""

import math
import sys

import pytest

from jaxrl_agentic.envs.outside_agent import (
    agent_metrics,
    checked_reward,
    outside_agent_factory,
)
from jaxrl_agentic.rollout.groups import EpisodeSpec


def spec(seed):
    return EpisodeSpec(seed=seed, group_id=0, member=0)


def test_tasks_follow_the_seeds_and_a_task_fn_or_the_seed_stands_in():
    factory = outside_agent_factory(agent_fn="math:hypot", tasks=["x", "y", "z"])
    # Training seeds 0, 2, 4, 6 and validation seeds 1, 3, 5 both walk the list.
    assert [factory(spec(s), 0).task for s in (0, 2, 4, 6, 1, 3, 5)] == list("xyzxxyz")
    assert factory(spec(0), 0).agent is math.hypot
    assert outside_agent_factory(agent_fn=math.hypot, task_fn="builtins:str")(
        spec(8), 0).task == "8"
    assert outside_agent_factory(agent_fn=math.hypot)(spec(8), 0).task == 8
    with pytest.raises(RuntimeError, match="OpenAI-compatible endpoint"):
        factory(spec(0), 0).reset(0)


@pytest.mark.parametrize("config, message", [
    ({}, "agent_fn / agent_command: give exactly one"),
    ({"agent_fn": "math:hypot", "agent_command": "x"}, "give exactly one"),
    ({"agent_fn": "math.hypot"}, "agent_fn: must be 'module:function'"),
    ({"agent_fn": "no_such_module_xyz:f"}, "agent_fn: cannot import module"),
    ({"agent_fn": "math:nope"}, "agent_fn: module 'math' has no 'nope'"),
    ({"agent_fn": "math:pi"}, "agent_fn: 'math:pi' is not callable"),
    ({"agent_fn": "math:hypot", "tasks": []}, "tasks: must be a non-empty list"),
    ({"agent_fn": "math:hypot", "tasks": "abc"}, "tasks: must be a non-empty list"),
    ({"agent_fn": "math:hypot", "tasks": [1], "task_fn": "builtins:str"}, "at most one"),
    ({"agent_fn": "math:hypot", "agent_timeout_s": -1}, "agent_timeout_s: must be >= 0"),
])
def test_bad_options_are_one_line_errors(config, message):
    with pytest.raises(ValueError, match=message):
        outside_agent_factory(**config)


def test_an_agent_program_gets_its_endpoint_and_task_and_prints_its_reward():
    script = ("import json, os; t = json.loads(os.environ['AGENT_TASK']); "
              "print('log line'); print(len(os.environ['OPENAI_BASE_URL']) + t['n'])")
    env = outside_agent_factory(agent_command=[sys.executable, "-c", script],
                                tasks=[{"n": 2}])(spec(0), 0)
    assert env.agent("http://x", "key", env.task) == 10.0
    failing = outside_agent_factory(agent_command=[sys.executable, "-c", "exit(3)"])
    with pytest.raises(RuntimeError, match="exited with 3"):
        failing(spec(0), 0).agent("u", "k", 0)


def test_rewards_must_be_finite_numbers():
    assert checked_reward(1) == 1.0
    for bad in (math.nan, math.inf, "1", None, True):
        with pytest.raises(ValueError):
            checked_reward(bad)


def test_agent_counts_are_summed_over_a_batch():
    batch = [{"agent/failures": 1.0, "agent/requests": 3.0, "success": 1.0},
             {"agent/failures": 0.0, "agent/requests": 2.0}, {"success": 0.0}]
    assert agent_metrics(batch, "env/") == {"env/agent/failures": 1.0,
                                            "env/agent/requests": 5.0}
    assert agent_metrics([{"success": 1.0}]) == {}
