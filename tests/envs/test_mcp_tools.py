"""MCP servers over stdio as tools of a `ToolEnv`: schemas, results, errors, hangs, crashes.

The server is `mcp_test_server.py` next to this file, run as a real subprocess.
"""

import asyncio
import importlib.util
import json
import shlex
import sys
import time
from pathlib import Path

import pytest

from jaxrl_agentic.envs import mcp_tools as mcp_tools_module
from jaxrl_agentic.envs.mcp_tools import (
    MCPServer,
    MCPServerError,
    MCPToolError,
    close_mcp_servers,
    mcp_server,
    mcp_tools,
    wait_for_restarts,
)
from jaxrl_agentic.envs.python_env import make_python_env
from jaxrl_agentic.envs.tools import ToolEnv, format_tool_call

SERVER_SCRIPT = Path(__file__).with_name("mcp_test_server.py")
COMMAND = f"{shlex.quote(sys.executable)} {shlex.quote(str(SERVER_SCRIPT))}"
SECOND = f"{COMMAND} second"  # the script ignores its arguments
NAMES = ["add", "echo", "fail", "hang", "crash"]


class MCPTask(ToolEnv):
    """A task for the tests: the answer is 7, known only through the server's `add`."""

    def new_task(self, seed):
        return "Question: what is 3 + 4?", 7


def _call(name, **arguments) -> str:
    return format_tool_call(name, arguments)


@pytest.fixture(scope="module")
def tools():
    """The test server's tools, through the per-process cache (one server for the module)."""
    yield mcp_tools([COMMAND])
    close_mcp_servers()


def _declared_tools() -> dict:
    """What the server module declares, read in-process from its `MCPServer` object."""
    spec = importlib.util.spec_from_file_location("mcp_test_server", SERVER_SCRIPT)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return {t.name: t for t in asyncio.run(module.server.list_tools())}


def test_listed_tools_carry_the_server_schemas(tools):
    declared = _declared_tools()
    assert [t.name for t in tools] == NAMES and set(declared) == set(NAMES)
    for tool in tools:
        assert tool.parameters == declared[tool.name].input_schema
        assert tool.description == declared[tool.name].description
        assert tool.schema["function"]["parameters"] == declared[tool.name].input_schema
    add = next(t for t in tools if t.name == "add")
    assert add.parameters["properties"]["a"]["type"] == "integer"
    assert add.parameters["required"] == ["a", "b"]


def test_tool_fn_calls_the_server(tools):
    by_name = {t.name: t for t in tools}
    assert by_name["add"].fn(a=347, b=-12) == "335"
    assert by_name["echo"].fn(text="héllo\nworld") == "héllo\nworld"
    # one server per command per process
    assert mcp_server(COMMAND) is mcp_server(f"  {COMMAND} ")
    assert mcp_tools([COMMAND, COMMAND])[0].name == "add"  # a repeated command counts once


def test_a_tool_env_episode_routes_calls_to_the_server(tools):
    env = MCPTask(tools)
    assert [s["function"]["name"] for s in env.tool_schemas] == NAMES
    env.reset(0)
    step = env.step("Let me add.\n" + _call("add", a=3, b=4))
    assert step.tool_messages == ("7",) and (step.tool_calls, step.tool_errors) == (1, 0)
    assert step.action_is_valid and not step.terminated
    done = env.step("<answer>7</answer>")
    assert done.terminated and done.success and done.reward == 1.0


def test_a_server_error_is_a_counted_tool_error(tools):
    with pytest.raises(MCPToolError, match="the disk is on fire"):
        next(t for t in tools if t.name == "fail").fn(message="the disk is on fire")
    env = MCPTask(tools, tool_error_penalty=0.25)
    env.reset(0)
    step = env.step(_call("fail", message="no such file") + _call("add", a=1, b=2))
    assert step.tool_messages[0].startswith("Error: ") and "no such file" in step.tool_messages[0]
    assert step.tool_messages[1] == "3"
    assert (step.tool_calls, step.tool_errors, step.tool_timeouts) == (2, 1, 0)
    assert step.reward == -0.25 and step.action_is_effective
    # arguments the schema refuses never reach the server
    bad = env.step(_call("add", a="3", b=4))
    assert bad.tool_errors == 1 and "must be a integer" in bad.tool_messages[0]


def test_a_hung_call_is_a_counted_timeout_and_the_server_goes_on(tools):
    env = MCPTask(tools, call_timeout_s=0.3)
    env.reset(0)
    start = time.monotonic()
    step = env.step(_call("hang", seconds=30.0))
    assert time.monotonic() - start < 2.0
    assert (step.tool_calls, step.tool_errors, step.tool_timeouts) == (1, 1, 1)
    assert "timed out" in step.tool_messages[0] and not step.terminated
    # the abandoned call is still pending on the server; the session answers others
    later = env.step(_call("add", a=20, b=22))
    assert later.tool_messages == ("42",) and later.tool_errors == 0


def _second() -> MCPServer:
    """A second server of the same script (another cache key), with a short call timeout."""
    return mcp_server(SECOND, call_timeout_s=0.5)


def test_the_server_side_timeout_ends_a_hung_call(tools):
    server = _second()
    by_name = {t.name: t for t in server.list_tools()}
    start = time.monotonic()
    with pytest.raises(TimeoutError, match="hang timed out after 0.5 s"):
        by_name["hang"].fn(seconds=30.0)
    assert time.monotonic() - start < 2.0 and server.alive
    assert by_name["add"].fn(a=1, b=1) == "2"
    # inside a ToolEnv whose own deadline is longer: a counted error, and the episode goes on
    env = MCPTask(list(by_name.values()), call_timeout_s=5.0)
    env.reset(0)
    step = env.step(_call("hang", seconds=30.0) + _call("add", a=3, b=4))
    assert step.tool_errors == 1 and "timed out" in step.tool_messages[0]
    assert step.tool_messages[1] == "7"


def test_two_servers_with_one_tool_name_are_refused(tools):
    with pytest.raises(ValueError, match="'add' is offered by two servers") as info:
        mcp_tools([COMMAND, SECOND])
    assert repr(COMMAND) in str(info.value) and repr(SECOND) in str(info.value)
    with pytest.raises(TypeError):
        mcp_tools(COMMAND)


def test_a_crash_is_no_tool_error_and_later_calls_fail_fast(tools):
    """A server's own tools (`MCPServer.list_tools`, no restart): the call it died in and
    every later one raise `MCPServerError` out of `ToolEnv.step` (the rollout ends the
    episode as an environment error), never an `Error:` tool message charged to the model."""
    server = _second()
    env = MCPTask(server.list_tools(), call_timeout_s=5.0)
    env.reset(0)
    start = time.monotonic()
    with pytest.raises(MCPServerError, match="is not running \\(connection closed\\)"):
        env.step(_call("crash"))
    assert not server.alive
    with pytest.raises(MCPServerError, match="connection closed"):
        env.step(_call("add", a=3, b=4) + _call("echo", text="hi"))
    assert time.monotonic() - start < 3.0  # the crash and the calls after it: no hang
    with pytest.raises(MCPServerError, match="connection closed"):
        server.list_tools()
    # the cache replaces a dead server with a fresh one
    fresh = _second()
    assert fresh is not server and fresh.alive
    add = {t.name: t for t in fresh.list_tools()}["add"]
    assert json.loads(add.fn(a=5, b=6)) == 11
    # a closed server refuses calls at once; close() is idempotent
    fresh.close()
    fresh.close()
    assert not fresh.alive
    with pytest.raises(MCPServerError, match="is closed"):
        add.fn(a=1, b=2)


def test_a_server_that_does_not_start_is_an_error_at_once():
    start = time.monotonic()
    with pytest.raises(MCPServerError, match="failed to start: FileNotFoundError"):
        MCPServer("/nonexistent/mcp-server --flag")
    silent = f"{shlex.quote(sys.executable)} -c {shlex.quote('import sys; sys.stdin.read()')}"
    with pytest.raises(MCPServerError, match="failed to start"):
        MCPServer(silent, startup_timeout_s=0.5)
    quits = f"{shlex.quote(sys.executable)} -c pass"
    with pytest.raises(MCPServerError, match="failed to start"):
        MCPServer(quits)
    assert time.monotonic() - start < 8.0
    with pytest.raises(ValueError, match="must not be empty"):
        MCPServer("   ")


def test_without_the_mcp_package_the_error_says_how_to_install(monkeypatch):
    monkeypatch.setitem(sys.modules, "mcp", None)
    with pytest.raises(ImportError, match=r"pip install -e '\.\[envs\]'"):
        MCPServer(COMMAND)
    assert mcp_tools_module.mcp_tools([]) == []


def test_mcp_servers_in_a_tool_environments_config_offer_their_tools(tools):
    """`mcp_servers=[command]` in the calculator's env_config: the episode lists the server's
    tools beside `calculate` and routes a call to the server."""
    factory = make_python_env("calculator", mcp_servers=(COMMAND,), operations=1)
    env = factory(None, 0)
    env.reset(3)
    assert {"calculate", *NAMES} <= {s["function"]["name"] if "function" in s else s["name"]
                                     for s in env.tool_schemas}
    step = env.step(_call("add", a=20, b=22))
    assert step.tool_messages == ("42",) and step.tool_errors == 0


# ---- a server that died: restarted, and its call is the infrastructure's fault -------------

RESTARTING = f"{COMMAND} restarting"  # its own server (another cache key)


@pytest.fixture(scope="module")
def tiny_tokenizer(tiny_model_dir):
    import transformers

    return transformers.AutoTokenizer.from_pretrained(tiny_model_dir)


def _play(factory, tokenizer, call: str, seed: int = 0):
    """One calculator episode through `PythonRolloutRunner`: the reply `call`, then an
    answer once a tool message came back."""
    from jaxrl_agentic.envs.tools import tool_responses
    from jaxrl_agentic.rollout.conversation import ChatFormatter
    from jaxrl_agentic.rollout.groups import EpisodeSpec
    from jaxrl_agentic.rollout.python_runner import PythonRolloutRunner
    from jaxrl_agentic.rollout.turns import GenerationConfig
    from jaxrl_agentic.warmup import ScriptedSampler, text_policy_replies

    def policy(text):
        return "<answer>0</answer>" if tool_responses(text) else call

    formatter = ChatFormatter(tokenizer)
    sampler = ScriptedSampler(text_policy_replies(formatter, lambda rng: policy, seed=0),
                              max_total_len=8192)
    runner = PythonRolloutRunner(factory, sampler, formatter, tag="calculator", max_turns=2,
                                 max_input_length=6000,
                                 generation=GenerationConfig(max_tokens_per_step=256))
    (traj,) = runner.run([EpisodeSpec(seed=seed, group_id=0, member=0)], sample_seed=0)
    return traj, runner.stats


def test_a_crashed_server_ends_its_episode_as_an_error_and_is_restarted(tiny_tokenizer,
                                                                        caplog):
    """The call the server died in is no tool error of the model: its episode ends as an
    environment error (`env/errors`), reward 0, no `tool_error_penalty`; the next episode's
    call reaches a restarted server."""
    factory = make_python_env("calculator", mcp_servers=(RESTARTING,), operations=1,
                              tool_error_penalty=0.25)
    try:
        first = mcp_server(RESTARTING)
        with caplog.at_level("WARNING", logger="jaxrl_agentic.envs.mcp_tools"):
            crashed, stats = _play(factory, tiny_tokenizer, _call("crash"))
        assert crashed.metrics["env_error"] == 1.0 and stats["errors"] == 1
        assert crashed.truncated and [t.reward for t in crashed.turns] == [0.0]
        assert not first.alive and "restart 1 of 3" in caplog.text
        wait_for_restarts()  # restarted in the background, outside any call's deadline
        after, stats = _play(factory, tiny_tokenizer, _call("add", a=3, b=4))
        assert after.metrics["env_error"] == 0.0 and stats["errors"] == 0
        assert after.metrics["tool/calls"] == 1.0 and after.metrics["tool/errors"] == 0.0
        assert after.terminated and after.turns[0].reward == 0.0  # the call: no penalty
        assert mcp_server(RESTARTING) is not first and mcp_server(RESTARTING).alive
    finally:
        close_mcp_servers()


def test_past_its_restart_budget_a_dead_server_ends_episodes_as_errors():
    """Restarts per environment (`mcp_tools` call): one here. Another environment on the
    same server, with none of its own, takes over the restarted server."""
    from jaxrl_agentic.envs.tools import ToolUnavailableError

    env = MCPTask(mcp_tools([RESTARTING], max_restarts=1, call_timeout_s=5.0))
    other = MCPTask(mcp_tools([RESTARTING], max_restarts=0))
    try:
        for restarts_left in (True, False):
            env.reset(0)
            with pytest.raises(ToolUnavailableError, match="is not running"):
                env.step(_call("crash"))  # raises out of step: the episode ends as an error
            wait_for_restarts()
            env.reset(0)
            other.reset(0)
            if restarts_left:  # restarted once, for both
                assert env.step(_call("add", a=3, b=4)).tool_messages == ("7",)
                assert other.step(_call("add", a=1, b=1)).tool_messages == ("2",)
            else:  # not again: every call ends its episode, none is the model's error
                for _ in range(2):
                    with pytest.raises(ToolUnavailableError, match="1 restart spent"):
                        env.step(_call("add", a=3, b=4))
                with pytest.raises(ToolUnavailableError, match="0 restarts spent"):
                    other.step(_call("add", a=1, b=1))
    finally:
        close_mcp_servers()


def test_call_timeout_0_means_no_deadline_with_mcp_servers(tools):
    """`call_timeout_s=0` ("no deadline") is taken by a tool environment with MCP servers,
    and the server's calls then have none either (the session waits for the answer)."""
    command = f"{COMMAND} no-deadline"  # started here, with the environment's deadline
    factory = make_python_env("calculator", mcp_servers=(command,), call_timeout_s=0)
    env = factory(None, 0)
    env.reset(3)
    step = env.step(_call("hang", seconds=0.2) + _call("add", a=1, b=2))
    assert step.tool_messages == ("woke", "3") and step.tool_errors == 0
    assert mcp_server(command).call_timeout_s == 0.0
    server = MCPServer(SECOND, call_timeout_s=0)
    try:
        assert server.call_timeout_s == 0.0
        assert server.call_tool("hang", {"seconds": 0.2}) == "woke"
    finally:
        server.close()
    with pytest.raises(ValueError, match="call_timeout_s must be >= 0"):
        MCPServer(SECOND, call_timeout_s=-1)
