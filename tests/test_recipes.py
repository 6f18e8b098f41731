"""Every recipe in configs/ trains two steps at tiny size (its own module, so the test
runner can put these runs beside the rest of tests/test_train.py)."""

import pytest

from jaxrl_agentic import train
from tests.test_train import RECIPES, check_outputs, tiny_overrides


@pytest.mark.parametrize("recipe", [r for r in RECIPES if r != "frozen_lake"])
def test_recipe_runs_at_tiny_size(recipe, tmp_path):
    out = str(tmp_path / recipe)
    assert train.main(["train", *tiny_overrides(recipe, out)]) == 0
    tools = "tool" in recipe
    # Tool, reasoning-gym and TextArena environments have no picture: no GIFs.
    pictureless = tools or recipe in ("reasoning_gym", "textarena")
    records = check_outputs(out, 2, gifs=not pictureless)
    assert records[1]["time/elapsed"] > records[0]["time/elapsed"]  # one uninterrupted run
    assert records[-1]["rollout/logprob_mismatch"] < 1e-2 or recipe.startswith("qwen")
    if tools:
        for key in ("env/tool/calls", "env/tool/calls_per_episode", "eval/tool/calls",
                    "render/skipped"):
            assert key in records[-1], key
