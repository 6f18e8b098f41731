"""docs/extending.md's recipe files, each outside the package, train for 2 pipeline steps
with what they register (the same small shapes as the other pipeline tests)."""

import functools
import os

import numpy as np
import pytest

from jaxrl_agentic.algos import estimators, policy_losses
from jaxrl_agentic.config import validate
from jaxrl_agentic.pipeline import Pipeline
from jaxrl_agentic.train import parse_config
from tests.test_pipeline_sharded import ROOT, small_overrides

EXAMPLES = os.path.join(ROOT, "docs", "examples")


def example_config(name: str, out: str, *extra: str):
    """The example recipe at the small test shapes; its own choices (loss, estimator) stay."""
    overrides = [o for o in small_overrides(out)
                 if not o.startswith(("--config=", "--config.adv_estimator="))]
    c = parse_config(["train", f"--config={os.path.join(EXAMPLES, name)}", *overrides, *extra])
    validate(c)
    return c


def counted(registry: dict, name: str, field: str):
    """Wraps a registered function so that the test sees it called; returns the counter."""
    calls = []
    entry = registry[name]
    original = getattr(entry, field)

    @functools.wraps(original)
    def spy(*args, **kwargs):
        calls.append(1)
        return original(*args, **kwargs)

    registry[name] = type(entry)(**{**entry.__dict__, field: spy})
    return calls


def train_two_steps(c) -> list[dict]:
    pipe = Pipeline(c, log=lambda line: None)
    try:
        return [pipe.train_step() for _ in range(2)]
    finally:
        pipe.close()


def test_a_recipe_with_its_own_policy_loss_trains(tmp_path):
    c = example_config("custom_policy_loss.py", str(tmp_path))
    assert c.policy_loss == "tapered_reinforce"
    calls = counted(policy_losses._LOSSES, "tapered_reinforce", "sums")
    for metrics, _, samples in train_two_steps(c):
        assert samples and np.isfinite(metrics["actor/pg_loss"])
        assert metrics["actor/grad_norm"] > 0
    assert calls  # traced into the train step


def test_a_recipe_with_its_own_advantage_estimator_trains(tmp_path):
    c = example_config("custom_advantage_estimator.py", str(tmp_path))
    assert c.adv_estimator == "group_rank"
    calls = counted(estimators._ESTIMATORS, "group_rank", "fn")
    for metrics, _, samples in train_two_steps(c):
        assert samples and np.isfinite(metrics["actor/pg_loss"])
        for s in samples:  # ranks scaled to [−1, 1]
            assert np.all(np.abs(s.advantages[s.loss_mask > 0]) <= 1.0)
    assert len(calls) == 2  # once per step


@pytest.mark.parametrize("name", ["custom_policy_loss.py", "custom_advantage_estimator.py"])
def test_the_examples_are_documented(name):
    with open(os.path.join(ROOT, "docs", "extending.md")) as f:
        assert f"docs/examples/{name}" in f.read()
