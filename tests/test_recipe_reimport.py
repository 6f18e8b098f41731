"""A recipe file runs again each time a config is read from it: the registrations it makes
are the same ones again (a no-op), so a typo'd override on a recipe that registers an
environment and a loss is the one-line unknown-field error, not a registry conflict."""

import functools
import textwrap

import pytest

from jaxrl_agentic import train
from jaxrl_agentic.algos import estimators, policy_losses
from jaxrl_agentic.envs import registry
from jaxrl_agentic.sampling import backends
from tests.test_train import ROOT
from tests.test_train_config_errors import RECIPE

ENV, LOSS = "reimported_lake", "reimported_ppo"

RECIPE_FILE = f"""
import os

from jaxrl_agentic.algos.policy_losses import get_policy_loss, register_policy_loss
from jaxrl_agentic.config import recipe_config
from jaxrl_agentic.envs import register
from jaxrl_agentic.envs.frozen_lake import FrozenLake


def lake():
    return FrozenLake()


def ppo_again(*args, **kwargs):
    return get_policy_loss("ppo").sums(*args, **kwargs)


register({ENV!r}, lake)
register_policy_loss({LOSS!r}, ppo_again)


def get_config():
    c = recipe_config(os.path.join({ROOT!r}, {RECIPE!r}))
    c.custom_envs.frozen_lake.env_type = {ENV!r}
    c.policy_loss = {LOSS!r}
    return c
"""


@pytest.fixture
def registering_recipe(tmp_path):
    path = tmp_path / "registering_recipe.py"
    path.write_text(textwrap.dedent(RECIPE_FILE))
    yield str(path)
    registry._REGISTRY.pop(ENV, None)
    policy_losses._LOSSES.pop(LOSS, None)


@pytest.mark.parametrize("override, fragment", [
    ("max_step=3", "config.max_step: unknown field; did you mean 'max_steps'? allowed: "),
    ("nonexistent_field=3", "config.nonexistent_field: unknown field; allowed: "),
])
def test_a_typo_on_a_registering_recipe_is_the_one_line_field_error(
        registering_recipe, override, fragment, capsys, tmp_path):
    argv = ["train", f"--config={registering_recipe}", f"--config.output_dir={tmp_path}",
            f"--config.{override}"]
    assert train.main(argv) == train.EXIT_BAD_INPUT
    err = capsys.readouterr().err.strip()
    assert "\n" not in err and "\\n" not in err and "Traceback" not in err, err
    assert err.startswith(f"error: {fragment}"), err


def test_the_recipe_reads_twice_with_what_it_registers(registering_recipe):
    for _ in range(2):
        c = train.parse_config(["train", f"--config={registering_recipe}"])
        assert (c.custom_envs.frozen_lake.env_type, c.policy_loss) == (ENV, LOSS)


def _defined(source: str, name: str, path: str = "/recipes/one.py"):
    """`name` as the module `source`, written at `path`, defines it when it runs."""
    namespace = {"__name__": "config_config"}  # the name every recipe file runs under
    exec(compile(source, path, "exec"), namespace)
    return namespace[name]


def _defined_twice(source: str, name: str):
    """Two objects from one definition, as a recipe read twice makes them."""
    return _defined(source, name), _defined(source, name)


def _check_registry(register, registered, names, name, first, again, other):
    try:
        register(name, first)
        register(name, first)  # the same object
        register(name, again)  # the same definition, made again
        assert registered(name) is not None
        with pytest.raises(ValueError, match="already registered"):
            register(name, other)
        register(name, other, replace=True)
    finally:
        names.pop(name, None)


SOURCE = ("def fn(*args, **kwargs):\n    return None\n\n\n"
          "def other(*args, **kwargs):\n    return 1\n")


@pytest.mark.parametrize("which", ["env", "policy_loss", "estimator", "sampler_backend"])
def test_registries_take_the_same_definition_again_and_refuse_another(which):
    first, again = _defined_twice(SOURCE, "fn")
    other = _defined(SOURCE, "other")
    assert first is not again
    name = f"reregistered_{which}"
    if which == "env":
        _check_registry(functools.partial(registry.register, backend="python"),
                        registry.registered_env, registry._REGISTRY, name, first, again, other)
    elif which == "policy_loss":
        _check_registry(policy_losses.register_policy_loss, policy_losses.get_policy_loss,
                        policy_losses._LOSSES, name, first, again, other)
    elif which == "estimator":
        _check_registry(estimators.register_advantage_estimator,
                        estimators.get_advantage_estimator, estimators._ESTIMATORS, name,
                        first, again, other)
    else:
        _check_registry(backends.register_sampler_backend,
                        lambda n: n in backends.sampler_backend_names(), backends._BACKENDS,
                        name, first, again, other)


def test_the_same_definition_under_other_settings_is_a_conflict():
    first, again = _defined_twice(SOURCE, "fn")
    try:
        registry.register("reregistered_env", first, backend="python")
        with pytest.raises(ValueError, match="already registered"):
            registry.register("reregistered_env", again, backend="jax")
        policy_losses.register_policy_loss("reregistered_loss", first)
        with pytest.raises(ValueError, match="already registered"):
            policy_losses.register_policy_loss("reregistered_loss", again, bounds="cispo_clip")
    finally:
        registry._REGISTRY.pop("reregistered_env", None)
        policy_losses._LOSSES.pop("reregistered_loss", None)


def test_same_definition_is_where_it_is_written():
    from jaxrl_agentic.registration import same_registration

    first, again = _defined_twice(SOURCE, "fn")
    assert same_registration(first, again)
    # The same name in another recipe file (every recipe runs as the module config_config).
    assert not same_registration(first, _defined(SOURCE, "fn", "/recipes/two.py"))
    lambdas = "a = lambda: 1\nb = lambda: 2\n"
    (a1, a2), (b1, _) = _defined_twice(lambdas, "a"), _defined_twice(lambdas, "b")
    assert same_registration(a1, a2) and not same_registration(a1, b1)
    classes = "class Env:\n    def reset(self):\n        return 0\n\n\nclass Bare:\n    pass\n"
    (e1, e2), (bare1, bare2) = _defined_twice(classes, "Env"), _defined_twice(classes, "Bare")
    assert same_registration(e1, e2) and not same_registration(e1, bare1)
    assert not same_registration(bare1, bare2)  # nothing says where it is written: identity
    assert same_registration(functools.partial(first, k=1), functools.partial(again, k=1))
    assert not same_registration(functools.partial(first, k=1), functools.partial(again, k=2))
