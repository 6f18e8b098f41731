"""Tool environments in the pipeline: a train step's metrics carry the batch's tool-call
counts (`envs.tools.tool_metrics` over the episodes' `tool/*`), overall and per env tag."""

import os

import pytest

from jaxrl_agentic.config import validate
from jaxrl_agentic.data.trajectory import Trajectory
from jaxrl_agentic.envs.calculator import CalculatorOracle, random_calculator_policy
from jaxrl_agentic.envs.tools import CALL_CLOSE, CALL_OPEN
from jaxrl_agentic.pipeline import Pipeline, trajectory_metrics
from jaxrl_agentic.train import parse_config
from jaxrl_agentic.warmup import ScriptedSampler, text_policy_replies

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
GARBLED = f"{CALL_OPEN}{{not json}}{CALL_CLOSE}"


def garbled_then_oracle(rng):
    """Per episode: one garbled call, the right call, then the right answer."""
    del rng
    oracle, seen = CalculatorOracle(), []

    def reply(text):
        seen.append(text)
        if len(seen) == 1:
            return GARBLED
        return oracle.reply(seen[0] if len(seen) == 2 else text)  # problem, then the result

    return reply


@pytest.fixture(scope="module")
def recipe_pipeline(tmp_path_factory):
    """The tool recipe (tool tokenizer, two-digit problems), 4 groups of 4, flat rows, no
    warm-up: its replies are scripted per test."""
    c = parse_config([
        "train", f"--config={os.path.join(ROOT, 'configs', 'tool_calculator.py')}",
        f"--config.output_dir={tmp_path_factory.mktemp('tools')}",
        "--config.format_warmup.steps=0", "--config.max_steps=2",
        "--config.train_env_manager.num_env_groups=4",
        "--config.train_env_manager.group_size=4", "--config.mini_batch_size=16",
        # Flat rows: what is checked does not depend on the layout, and they compile less.
        "--config.share_group_prefix=False", "--config.micro_batch_max_tokens=1024"])
    validate(c)
    pipe = Pipeline(c)
    yield pipe
    pipe.close()


def scripted_step(pipe, make_policy, seed=0):
    """One train step whose replies `make_policy(rng)(new_text)` writes, played through the
    pipeline's own runner (prompts, tool messages, metrics as in RL)."""
    runner = pipe.runners["calculator"]
    runner.sampler = ScriptedSampler(text_policy_replies(pipe.formatter, make_policy, seed),
                                     max_total_len=pipe.sampler.max_total_len)
    return pipe.train_step()


def test_a_train_step_logs_the_tool_calls_of_its_episodes(recipe_pipeline):
    # The tiny random policy would not call the tool: the replies are scripted.
    metrics, trajs, _ = scripted_step(recipe_pipeline, garbled_then_oracle)
    assert len(trajs) == 16 and all(t.metrics["success"] == 1.0 for t in trajs)
    assert metrics["env/tool/calls"] == 32.0  # 2 per episode, the garbled one included
    assert metrics["env/tool/errors"] == 16.0
    assert metrics["env/tool/timeouts"] == 0.0
    assert metrics["env/tool/calls_per_episode"] == 2.0
    assert metrics["env/tool/valid_fraction"] == 0.5


def test_the_tool_recipe_has_a_learning_signal_from_the_warmup_policy(recipe_pipeline):
    # What RL starts from: the format warm-up's policy (well-formed calls on the problem's
    # numbers, a random operator). A quarter of its calls pick the right operator, so
    # groups of one problem mix successes and failures: non-zero advantages.
    metrics, trajs, samples = scripted_step(
        recipe_pipeline, lambda rng: random_calculator_policy(rng, call_style="compact"),
        seed=3)
    assert metrics["env/tool/valid_fraction"] == 1.0 and metrics["env/tool/errors"] == 0.0
    assert 0 < sum(t.metrics["success"] for t in trajs) < len(trajs)
    assert metrics["batch/zero_variance_groups"] < 4
    assert any(abs(float(a)) > 0.1 for s in samples for a in s.advantages[s.loss_mask > 0])
    assert metrics["actor/grad_norm"] > 0


def _traj(tag, calls=None):
    t = Trajectory(traj_id=0, group_id=0, tag=tag, seed=0, tokens=[], turns=[])
    t.metrics = {"success": 0.0, "return": 0.0, "action_is_valid": 1.0,
                 "action_is_effective": 1.0}
    if calls is not None:
        t.metrics.update({"tool/calls": calls, "tool/errors": 1.0, "tool/timeouts": 0.0})
    return t


def test_tool_metrics_are_per_tag_and_absent_for_envs_without_tools():
    trajs = [_traj("calc", 3.0), _traj("calc", 1.0), _traj("lake")]
    m = trajectory_metrics(trajs, "eval/")
    assert m["eval/tool/calls"] == 4.0 and m["eval/tool/calls_per_episode"] == 2.0
    assert m["eval/calc/tool/calls"] == 4.0 and m["eval/calc/tool/errors"] == 2.0
    assert not any(k.startswith("eval/lake/tool/") for k in m)
    assert not any("tool/" in k for k in trajectory_metrics([_traj("lake")], "env/"))

