"""`openai_agent`'s env_config: the agent and task sources it takes, their one-line errors,
an agent program's reward read from its output, and batch totals of the agent counts."""

import math
import sys

import pytest

from jaxrl_agentic.envs.outside_agent import (
    AgentOutcome,
    agent_metrics,
    agent_outcome,
    checked_reward,
    load_callable,
    outside_agent_factory,
    run_agent,
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
    ({"agent_fn": "math.hypot"}, "agent_fn: must be 'module:function' or 'file.py:function'"),
    ({"agent_fn": "no_such_module_xyz:f"}, "agent_fn: cannot import module"),
    ({"agent_fn": "math:nope"}, "agent_fn: module 'math' has no 'nope'"),
    ({"agent_fn": "math:pi"}, "agent_fn: 'math:pi' is not callable"),
    ({"agent_fn": "math:hypot", "tasks": []}, "tasks: must be a non-empty list"),
    ({"agent_fn": "math:hypot", "tasks": "/no/such.jsonl"}, "tasks: cannot read '/no/such"),
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


def test_tasks_from_a_jsonl_file_and_the_agent_named_in_the_env_type(tmp_path):
    from jaxrl_agentic.envs.python_env import make_python_env

    path = tmp_path / "tasks.jsonl"
    path.write_text('{"q": 1}\n\n"two"\n')
    factory = make_python_env("agent:math:hypot", tasks=str(path))
    assert [factory(spec(s), 0).task for s in (0, 2, 4)] == [{"q": 1}, "two", {"q": 1}]
    assert factory(spec(0), 0).agent is math.hypot
    path.write_text('{"q": 1}\n{oops\n')
    with pytest.raises(ValueError, match=r"tasks\.jsonl:2 is not JSON"):
        outside_agent_factory(agent_fn="math:hypot", tasks=str(path))
    with pytest.raises(ValueError, match="names the agent already"):
        make_python_env("agent:math:hypot", agent_fn="math:sqrt")


def test_a_dict_outcome_adds_success_turn_rewards_and_metrics():
    assert agent_outcome(0.5) == AgentOutcome(0.5)
    assert agent_outcome({"reward": 1, "success": False, "turn_rewards": [0, -0.1],
                          "metrics": {"calls": 2}}) == AgentOutcome(
        1.0, False, (0.0, -0.1), {"calls": 2.0})
    for bad, message in [({"score": 1}, "needs 'reward'"),
                         ({"reward": 1, "extra": 2}, "needs 'reward'"),
                         ({"reward": 1, "success": 1}, "not a bool"),
                         ({"reward": 1, "turn_rewards": "0.1"}, "not a list"),
                         ({"reward": 1, "turn_rewards": [math.nan]}, "non-finite turn reward"),
                         ({"reward": 1, "metrics": [1]}, "not a dict"),
                         ({"reward": 1, "metrics": {"m": "x"}}, "metric 'm'")]:
        with pytest.raises(ValueError, match=message):
            agent_outcome(bad)


def test_an_async_agent_runs_in_an_event_loop_of_its_thread():
    import asyncio

    async def agent(base_url, api_key, task):
        await asyncio.sleep(0)
        return {"reward": len(base_url) + task}

    assert run_agent(agent, "http://x", "k", 2) == AgentOutcome(10.0)
    assert run_agent(lambda u, k, t: agent(u, k, t), "u", "k", 1) == AgentOutcome(2.0)


def test_an_agent_in_a_file_outside_any_package_is_loaded_once(tmp_path):
    path = tmp_path / "my_agent.py"
    path.write_text("CALLS = []\ndef solve(base_url, api_key, task):\n    return 1.0\n")
    solve = load_callable(f"{path}:solve", "agent_fn")
    assert solve("u", "k", None) == 1.0
    assert load_callable(f"{path}:solve", "agent_fn") is solve
    with pytest.raises(ValueError, match="agent_fn: cannot import module .*no such file"):
        load_callable(f"{tmp_path}/missing.py:solve", "agent_fn")
    with pytest.raises(ValueError, match="has no 'nope'"):
        load_callable(f"{path}:nope", "agent_fn")


def test_agent_counts_are_summed_over_a_batch():
    batch = [{"agent/failures": 1.0, "agent/requests": 3.0, "success": 1.0},
             {"agent/failures": 0.0, "agent/requests": 2.0}, {"success": 0.0}]
    assert agent_metrics(batch, "env/") == {"env/agent/failures": 1.0,
                                            "env/agent/requests": 5.0}
    # The agents' own metrics: a mean over the episodes that report them.
    assert agent_metrics([{"agent_metric/calls": 1.0}, {"agent_metric/calls": 2.0},
                          {"success": 1.0}]) == {"agent_metric/calls": 1.5}
    assert agent_metrics([{"success": 1.0}]) == {}
