"""configs/agent_calculator.py's agent (docs/examples/calculator_agent.py, a plain OpenAI
client) against the built-in `calculator` environment it rewrites from the outside: played
by the same scripted policies, through the endpoint and in process, the episodes are the
same token for token and earn the same rewards, so the two recipes' curves compare the
paths, not two tasks."""

import os

import numpy as np
import pytest
import transformers

from jaxrl_agentic.config import validate
from jaxrl_agentic.envs.calculator import CalculatorOracle
from jaxrl_agentic.envs.outside_agent import load_callable, outside_agent_factory
from jaxrl_agentic.envs.python_env import make_python_env
from jaxrl_agentic.rollout.conversation import ChatFormatter
from jaxrl_agentic.rollout.groups import EpisodeSpec
from jaxrl_agentic.rollout.python_runner import PythonRolloutRunner
from jaxrl_agentic.rollout.turns import GenerationConfig
from jaxrl_agentic.serving.agent_runner import agent_rollout_runner
from jaxrl_agentic.train import parse_config
from jaxrl_agentic.warmup import ScriptedSampler, text_policy_replies
from tests.test_pipeline_sharded import ROOT

pytest.importorskip("aiohttp")
pytest.importorskip("openai")
RECIPE = os.path.join(ROOT, "configs", "agent_calculator.py")


@pytest.fixture(scope="module")
def recipe():
    c = parse_config(["train", f"--config={RECIPE}"])
    validate(c)
    return c


def policies():
    """Scripted replies: the oracle (solves each problem with one call), and a policy that
    never calls nor answers (three nudges, the full penalty)."""
    return {"oracle": lambda rng: CalculatorOracle(call_style="compact").reply,
            "mute": lambda rng: (lambda text: "I am not sure.")}


@pytest.mark.parametrize("policy, max_turns", [("oracle", 3), ("mute", 3), ("mute", 2)])
def test_the_agent_plays_the_built_in_episode_token_for_token(recipe, tiny_tools_dir, policy,
                                                              max_turns):
    """With max_turns=2 the endpoint refuses the mute agent's third request (a 400): the
    agent ends its episode there, as the environment's ends truncated, not as a failure."""
    tok = transformers.AutoTokenizer.from_pretrained(tiny_tools_dir)
    formatter = ChatFormatter(tok)
    built_in, agent = recipe.custom_envs.calculator, recipe.custom_envs.agent
    specs = [EpisodeSpec(seed=s, group_id=i, member=0) for i, s in enumerate((0, 2, 7))]
    gen = GenerationConfig(agent.max_tokens_per_step)
    options = dict(max_turns=max_turns, max_input_length=recipe.max_input_length,
                   generation=gen)

    def scripted():
        return ScriptedSampler(text_policy_replies(formatter, policies()[policy], 0), 4096)

    env_config = {k: v for k, v in built_in.env_config.items()}
    inside = PythonRolloutRunner(
        make_python_env("calculator", format_penalty=built_in.format_penalty, **env_config),
        scripted(), formatter, tag="calculator", run_seed=0, step_timeout_s=30.0, **options)
    outside = agent_rollout_runner(outside_agent_factory(**agent.env_config), scripted(),
                                   formatter, tag="agent", **options)
    ours = inside.run(specs, sample_seed=0)
    theirs = outside.run(specs, sample_seed=0)
    assert len(ours) == len(theirs) == len(specs)
    for a, b in zip(ours, theirs, strict=True):
        assert a.tokens == b.tokens
        assert [u.generated for u in a.turns] == [u.generated for u in b.turns]
        assert [u.context_len for u in a.turns] == [u.context_len for u in b.turns]
        assert np.isclose(a.score, b.score) and a.metrics["success"] == b.metrics["success"]
    expected = {"oracle": (1.0, 2), "mute": (-0.1 * max_turns, max_turns)}[policy]
    assert all(np.isclose(t.score, expected[0]) and len(t.turns) == expected[1]
               for t in theirs)
    assert outside.stats["failures"] == 0
    # The agent's own metric rides on the episode (mean logged as env/agent_metric/...).
    assert [t.metrics["agent_metric/tool_calls"] for t in theirs] == [
        float(policy == "oracle")] * len(specs)


def test_the_agents_tool_is_the_environments():
    from jaxrl_agentic.envs.calculator import CALCULATE, CalculatorEnv, calculate

    agent = load_callable(f"{RECIPE[:-len('configs/agent_calculator.py')]}"
                          "docs/examples/calculator_agent.py:calculate", "f")
    module = __import__("sys").modules[agent.__module__]
    assert module.TOOLS == [CALCULATE.schema] and module.INSTRUCTIONS == CalculatorEnv.instructions
    for expression in ("12 + 30", "(12 + 30) * 4", "7 / 2", "10 / 3", "-4 - 5", "96 / 8"):
        assert agent(expression) == calculate(expression)
    for bad in ("__import__('os')", "2 ** 8", "x + 1"):
        with pytest.raises(ValueError):
            agent(bad)
