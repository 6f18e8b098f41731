"""scripts/analysis/try_env_ids.py: the recipe's per-environment settings are cleared for
another id, and an id that cannot run is a row with its one-line error, not a crash."""

import os

from tests.conftest import load_script

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def test_an_id_that_needs_the_network_is_a_row_with_its_error(tmp_path):
    script = load_script("scripts/analysis/try_env_ids.py")
    config = os.path.join(ROOT, "configs", "textarena.py")
    tag, env_config = script.recipe_tag(config)
    assert tag == "game" and env_config["game_kwargs"] == {"steps": 0}
    row = script.try_id(config, "textarena:Wordle-v0", 1, [], str(tmp_path))
    assert row["exit"] == 2 and "needs the network" in row["error"]
    assert row["error"].startswith("error:") and "eval/success" not in row
