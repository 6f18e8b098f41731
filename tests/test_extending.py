"""docs/extending.md's recipe files, each outside the package, train for 2 pipeline steps
with what they register (the same small shapes as the other pipeline tests)."""

import functools
import os
import re

import numpy as np
import pytest

from jaxrl_agentic.algos import estimators, policy_losses
from jaxrl_agentic.config import validate
from jaxrl_agentic.envs.python_env import PyStep, PythonTextEnv, text_state_hash
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


@pytest.mark.parametrize("name", ["custom_policy_loss.py", "custom_advantage_estimator.py",
                                  "custom_environment.py", "custom_tool.py",
                                  "calculator_agent.py"])
def test_the_examples_are_documented(name):
    with open(os.path.join(ROOT, "docs", "extending.md")) as f:
        assert f"docs/examples/{name}" in f.read()


def small_env_overrides(out: str, tag: str) -> list[str]:
    """2 steps at the shapes of the other pipeline tests, for a recipe with env tag `tag`."""
    return [f"--config.output_dir={out}", "--config.pretrain=tiny",
            "--config.format_warmup.steps=0", "--config.max_steps=2", "--config.save_steps=2",
            "--config.eval_steps=2", "--config.train_env_manager.num_env_groups=2",
            "--config.train_env_manager.group_size=2",
            "--config.val_env_manager.num_env_groups=2", "--config.mini_batch_size=4",
            f"--config.custom_envs.{tag}.max_turns=2", "--config.mesh.cpu_devices=1"]


def test_a_recipe_with_its_own_environment_trains(tmp_path):
    path = os.path.join(EXAMPLES, "custom_environment.py")
    c = parse_config(["train", f"--config={path}", *small_env_overrides(str(tmp_path), "guess")])
    validate(c)
    from jaxrl_agentic.envs.registry import resolve_backend

    assert resolve_backend(c.custom_envs.guess.env_type) == "python"  # declared, not set
    for metrics, trajs, samples in train_two_steps(c):
        assert trajs and all(t.turns for t in trajs) and samples
        assert "env/success" in metrics and np.isfinite(metrics["actor/pg_loss"])


def test_a_recipe_with_its_own_tool_offers_it(tmp_path):
    path = os.path.join(EXAMPLES, "custom_tool.py")
    c = parse_config(["train", f"--config={path}",
                      *small_env_overrides(str(tmp_path), "calculator"),
                      "--config.custom_envs.calculator.max_tokens_per_step=32"])
    validate(c)
    pipe = Pipeline(c, log=lambda line: None)
    try:
        metrics, trajs, samples = pipe.train_step()
        first = pipe.tokenizer.decode(trajs[0].tokens[:trajs[0].turns[0].context_len])
        assert '"name": "percent_of"' in first and '"name": "calculate"' in first
        assert samples and np.isfinite(metrics["actor/pg_loss"])
    finally:
        pipe.close()


def test_a_recipe_with_its_own_sampler_backend_generates_the_replies(tmp_path):
    """The traced backend of docs/examples/custom_sampler_backend.py plays every episode:
    the reply tokens it counted are the tokens the trajectories hold as generated."""
    c = example_config("custom_sampler_backend.py", str(tmp_path))
    assert c.sampler_backend == "traced_jax"
    pipe = Pipeline(c, log=lambda line: None)
    try:
        assert type(pipe.sampler).__name__ == "TracedSampler"
        pipe.sampler.trace.clear()  # the example's list, shared by every load of the file
        steps = [pipe.train_step() for _ in range(2)]
        traced = sum(e["reply_tokens"] for e in pipe.sampler.trace)
    finally:
        pipe.close()
    generated = sum(len(u.generated) for _, trajs, _ in steps for t in trajs for u in t.turns)
    assert generated > 0 and traced == generated
    for metrics, _, samples in steps:
        assert samples and metrics["actor/grad_norm"] > 0


def test_an_unknown_sampler_backend_is_a_config_error(tmp_path):
    from jaxrl_agentic.config import ConfigError

    with pytest.raises(ConfigError, match="^config.sampler_backend: 'vllm' is not allowed; "
                                          "choose one of jax"):
        example_config("custom_policy_loss.py", str(tmp_path), "--config.sampler_backend=vllm")


class _Delegating:
    """A backend with the protocol's methods that is not a JAX `Sampler` (composition)."""

    def __init__(self, inner):
        self.inner, self.max_total_len = inner, inner.max_total_len

    def new_session(self, num_rows, reserve=0):
        return self.inner.new_session(num_rows, reserve)

    def generate(self, prompts, **kwargs):
        return self.inner.generate(prompts, **kwargs)

    def set_params(self, params):
        self.inner.set_params(params)


@pytest.mark.parametrize("field, setting", [("rollout_batching", "continuous"),
                                            ("in_flight_updates", "True")])
def test_continuous_batching_needs_a_jax_sampler_backend(tmp_path, field, setting):
    from jaxrl_agentic.config import ConfigError
    from jaxrl_agentic.sampling import make_sampler_backend, register_sampler_backend

    register_sampler_backend(
        "delegating", lambda model, tok, **options: _Delegating(
            make_sampler_backend("jax", model, tok, **options)), replace=True)
    c = example_config("custom_policy_loss.py", str(tmp_path),
                       "--config.sampler_backend=delegating", f"--config.{field}={setting}")
    with pytest.raises(ConfigError, match=f"^config.{field}: 'continuous' decodes "
                                          "through the JAX sampler's slot programs"):
        Pipeline(c, log=lambda line: None)


def test_a_recipe_imports_a_module_beside_it(tmp_path, monkeypatch):
    """A recipe's folder is on sys.path while it loads (and after: its get_config and what
    it registers may import lazily), so a recipe can keep its environment in a module of
    its own."""
    import sys

    monkeypatch.setattr(sys, "path", list(sys.path))  # restored after the test
    monkeypatch.delitem(sys.modules, "beside_the_recipe_settings", raising=False)
    (tmp_path / "beside_the_recipe_settings.py").write_text("EXP_NAME = 'from_a_sibling'\n")
    (tmp_path / "recipe_with_a_sibling.py").write_text(
        "from beside_the_recipe_settings import EXP_NAME\n"
        "from jaxrl_agentic.config import default_config\n\n\n"
        "def get_config():\n"
        "    c = default_config()\n"
        "    c.exp_name = EXP_NAME\n"
        "    return c\n")
    c = parse_config(["train", f"--config={tmp_path / 'recipe_with_a_sibling.py'}"])
    assert c.exp_name == "from_a_sibling"
    assert sys.path[-1] == str(tmp_path)  # appended: installed packages keep their names
    parse_config(["train", "--config", str(tmp_path / "recipe_with_a_sibling.py")])
    assert sys.path.count(str(tmp_path)) == 1
    monkeypatch.delitem(sys.modules, "beside_the_recipe_settings", raising=False)


class _Pick(PythonTextEnv):
    """Name the secret colour: the secret is in the state, not in the text."""

    max_steps_in_episode = 2

    def __init__(self, format_penalty: float):
        self.secret = ""

    def reset(self, seed: int) -> str:
        self.secret = ("red", "green", "blue")[seed % 3]
        return "Name a colour: <answer>red</answer>, green or blue."

    def step(self, reply: str) -> PyStep:
        right = reply == f"<answer>{self.secret}</answer>"
        return PyStep(observation="again", reward=float(right), terminated=right,
                      action_is_valid=True, action_is_effective=True, success=right)

    def state_hash(self) -> bytes:
        return text_state_hash(self.secret)

    def warmup_reply(self, rng) -> str:  # the episode's own state, to show whose env it is
        return f"<answer>{self.secret}</answer>"


def test_a_python_environment_supplies_its_own_warmup_replies(tiny_model_dir):
    """`warmup_reply(rng)` on an environment without a built-in warm-up policy: the warm-up
    writes it, from each episode's own environment (here the secret, so every episode is
    solved at once), in place of the 'no format warm-up policy' error."""
    from jaxrl_agentic.config import default_config, env_spec
    from jaxrl_agentic.envs import register
    from jaxrl_agentic.models import load_pretrained
    from jaxrl_agentic.rollout.conversation import ChatFormatter
    from jaxrl_agentic.rollout.groups import EpisodeSpec
    from jaxrl_agentic.run_config import build_run_config
    from jaxrl_agentic.warmup import warmup_runners

    register("pick_test_env", lambda format_penalty=0.1: (
        lambda spec, run_seed: _Pick(format_penalty)), backend="python", replace=True)
    c = default_config()
    c.custom_envs = {"pick": env_spec("pick_test_env", max_turns=2, max_tokens_per_step=8)}
    c.train_env_manager.tags = c.val_env_manager.tags = ("pick",)
    c.format_warmup.steps = 1
    _, tok = load_pretrained(tiny_model_dir)
    [runner] = warmup_runners(build_run_config(c), ChatFormatter(tok))
    trajs = runner.run([EpisodeSpec(seed=s, group_id=s, member=0) for s in range(5)],
                       sample_seed=0)
    written = [tok.decode(t.turns[0].generated, skip_special_tokens=True) for t in trajs]
    assert written == [f"<answer>{('red', 'green', 'blue')[s % 3]}</answer>" for s in range(5)]
    assert all(t.metrics["success"] == 1.0 and len(t.turns) == 1 for t in trajs)


def _estimated(name: str, fn, level: str = "turn"):
    """Advantages of two hand-built episodes (2 and 3 turns) under estimator `fn`."""
    from tests.test_pipeline_filters import episode

    estimators.register_advantage_estimator(name, fn, level=level, replace=True)
    trajs = [episode(0, 0, [0.0, 1.0]), episode(1, 0, [0.0, 0.0, 0.0])]
    if level == "token":
        return estimators.token_advantages(trajs, adv_estimator=name)
    return estimators.turn_advantages(trajs, adv_estimator=name)


def test_an_estimators_number_per_episode_is_given_to_each_of_its_turns():
    # An outcome estimator written as one number per trajectory (documented), as the
    # data layer reads a scalar: every turn of the episode gets it.
    out = _estimated("per_episode_test", lambda trajs, keys, s: np.array([0.5, -0.5]))
    assert [a.tolist() for a in out] == [[0.5, 0.5], [-0.5, -0.5, -0.5]]


@pytest.mark.parametrize("fn, level, message", [
    (lambda trajs, keys, s: [np.ones(2), np.ones(2)], "turn",
     "advantage estimator 'wrong_output_test': trajectory 1 needs per-turn advantages of "
     "shape (3,), got shape (2,)"),
    (lambda trajs, keys, s: [np.ones(2)], "turn",
     "advantage estimator 'wrong_output_test' returned 1 entries for 2 trajectories"),
    (lambda trajs, keys, s: [np.ones(2), None], "turn",
     "advantage estimator 'wrong_output_test': trajectory 1 needs per-turn advantages of "
     "shape (3,), got NoneType"),
    (lambda trajs, keys, s: 1.0, "turn",
     "advantage estimator 'wrong_output_test' must return one entry per trajectory"),
    (lambda trajs, s, values: [np.ones(10), np.ones(15)], "token",
     "advantage estimator 'wrong_output_test' must return (advantages, returns or None)"),
    (lambda trajs, s, values: ([np.ones(10), np.ones(3)], None), "token",
     "advantage estimator 'wrong_output_test': trajectory 1 needs per-token advantages of "
     "shape (15,), got shape (3,)"),
])
def test_an_estimators_output_of_another_shape_is_one_clear_error(fn, level, message):
    with pytest.raises(ValueError, match="^" + re.escape(message)):
        _estimated("wrong_output_test", fn, level)


def test_the_pystep_fields_are_documented_as_they_are():
    """extending.md's table of `PyStep` fields: exactly the dataclass's, in its order, with
    the import path a Python environment uses."""
    import dataclasses

    with open(os.path.join(ROOT, "docs", "extending.md")) as f:
        text = f.read()
    assert "from jaxrl_agentic.envs.python_env import PyStep, PythonTextEnv" in text
    table = text.split("`PyStep` (a frozen dataclass", 1)[1].split("\n\n", 2)[1]
    documented = [name.strip(" `") for row in table.splitlines()[2:]
                  for name in row.split("|")[1].split(",")]
    assert documented == [f.name for f in dataclasses.fields(PyStep)]
