"""A run whose every episode's environment fails stops after a few steps with a clear error
(`train.EXIT_ENV_FAILED`), not a run that trains nothing and exits 0."""

import json
import os

from jaxrl_agentic import train

# A Python environment that cannot start an episode (a service that is down, say): every
# reset raises, so every episode ends without a turn (`env/errors` = 1).
BROKEN_ENV_RECIPE = '''
from jaxrl_agentic.config import default_config, env_manager, env_spec
from jaxrl_agentic.envs import register
from jaxrl_agentic.envs.python_env import PythonTextEnv


class Unreachable(PythonTextEnv):
    def __init__(self, format_penalty):
        pass

    def reset(self, seed):
        raise ConnectionError("the service is down")


register("unreachable_test_env", lambda format_penalty=0.1: (
    lambda spec, run_seed: Unreachable(format_penalty)), backend="python", replace=True)


def get_config():
    c = default_config()
    c.pretrain = "tiny"
    c.format_warmup.steps = 0
    c.max_steps = 6
    c.save_steps = c.eval_steps = 100
    c.custom_envs = {"down": env_spec("unreachable_test_env", max_turns=1,
                                      max_tokens_per_step=4)}
    c.train_env_manager = env_manager(num_env_groups=1, group_size=2, tags=("down",))
    c.val_env_manager = env_manager(num_env_groups=1, group_size=1, tags=("down",))
    return c
'''


def test_every_episode_failing_three_steps_in_a_row_stops_the_run(tmp_path, capsys):
    path = tmp_path / "broken_env_recipe.py"
    path.write_text(BROKEN_ENV_RECIPE)
    out = tmp_path / "out"
    assert train.main(["train", f"--config={path}", f"--config.output_dir={out}"]) \
        == train.EXIT_ENV_FAILED
    err = capsys.readouterr().err.strip().splitlines()[-1]
    assert err.startswith("error: every episode's environment failed in 3 consecutive steps "
                          "(last at step 3: env/errors=1, env/timeouts=0); stopping."), err
    with open(os.path.join(out, "metrics.jsonl")) as f:
        records = [json.loads(line) for line in f]
    assert [r["env/failed_streak"] for r in records] == [1, 2, 3]
    assert all(r["env/errors"] == 1.0 for r in records)


def test_a_step_with_one_working_episode_breaks_the_streak():
    from types import SimpleNamespace

    failed = SimpleNamespace(metrics={"env_error": 1.0, "env_timeout": 0.0})
    late = SimpleNamespace(metrics={"env_error": 0.0, "env_timeout": 1.0})
    fine = SimpleNamespace(metrics={"env_error": 0.0, "env_timeout": 0.0})
    jax_env = SimpleNamespace(metrics={})  # JAX environments record neither
    assert train.every_episode_failed([failed, late])
    assert not train.every_episode_failed([failed, late, fine])
    assert not train.every_episode_failed([jax_env]) and not train.every_episode_failed([])
