"""Every recipe in configs/ trains two steps at tiny size (its own module, so the test
runner can put these runs beside the rest of tests/test_train.py)."""

import json

import pytest

from jaxrl_agentic import train
from tests.conftest import load_script
from tests.test_train import RECIPES, check_outputs, tiny_overrides

# tool_multistep is the calculator recipe (its settings, by recipe_config) on the shop env,
# whose episodes, oracle and warm-up policy tests/envs/test_shop.py plays: its config is
# validated below instead of a third tool run at tiny size.
# The SmolLM2 recipes are the FrozenLake and calculator recipes' shapes on a real model
# (their runs are in docs/benchmarks.md); at tiny size they would repeat those two runs, so
# their configs are validated below instead.
REAL_MODEL_RECIPES = ("smollm2_frozen_lake", "smollm2_tool_calculator")
# The long-horizon recipe runs once, below, with episodes long enough to outgrow the context.
# agent_calculator: its agent and environment are checked token for token against the
# built-in calculator's (tests/test_agent_calculator.py), and training through the endpoint
# by tests/serving/test_agent_training.py; a tiny run of it costs ~75 s.
TINY_RUNS = [r for r in RECIPES
             if r not in ("frozen_lake", "tool_multistep", "tiny_long_frozen_lake",
                          "agent_calculator", *REAL_MODEL_RECIPES)]
# The distillation recipe's teacher is a run of configs/frozen_lake.py; at tiny size the
# tiny model stands in (a run's directory as the teacher: tests/pipeline/test_distillation.py).
STAND_INS = {"tiny_distill_frozen_lake": ["--config.teacher.pretrain=tiny"]}


@pytest.mark.parametrize("recipe", REAL_MODEL_RECIPES)
def test_the_real_model_recipes_validate_and_name_the_packaged_model(recipe):
    import os

    from jaxrl_agentic.config import validate
    from jaxrl_agentic.models.packaged import PACKAGED_MODELS
    from tests.test_train import ROOT

    c = train.parse_config(["train", f"--config={os.path.join(ROOT, 'configs', recipe)}.py"])
    validate(c)  # names the model without fetching it
    assert c.pretrain in PACKAGED_MODELS and c.lora_rank > 0 and c.eval_before_training


def test_the_multistep_tool_recipe_is_the_calculator_recipe_on_the_shop():
    import os

    from jaxrl_agentic.config import validate
    from tests.test_train import ROOT

    shop, calc = (train.parse_config(["train", f"--config={os.path.join(ROOT, 'configs', r)}"])
                  for r in ("tool_multistep.py", "tool_calculator.py"))
    validate(shop)
    assert list(shop.custom_envs) == ["shop"] and shop.format_warmup.max_turns == 3
    for key in ("pretrain", "learning_rate", "init_kl_coef", "share_group_prefix",
                "eval_before_training", "adv_estimator"):
        assert shop[key] == calc[key], key


@pytest.mark.parametrize("recipe", TINY_RUNS)
def test_recipe_runs_at_tiny_size(recipe, tmp_path, capsys):
    out = str(tmp_path / recipe)
    assert train.main(["train", *tiny_overrides(recipe, out), *STAND_INS.get(recipe, [])]) == 0
    tools = "tool" in recipe
    # Tool, reasoning-gym and TextArena environments have no picture: no GIFs.
    pictureless = tools or recipe in ("reasoning_gym", "textarena", "textarena_selfplay")
    records = check_outputs(out, 2, gifs=not pictureless)
    assert records[1]["time/elapsed"] > records[0]["time/elapsed"]  # one uninterrupted run
    assert records[-1]["rollout/logprob_mismatch"] < 1e-2 or recipe.startswith("qwen")
    if recipe == "textarena_selfplay":  # evaluated against its start (a frozen seat) too
        assert {"eval/vs_start/win_rate", "eval/vs_random/win_rate"} <= set(records[-1])
        check_elo_table(out, capsys)
    if recipe in STAND_INS:  # the teacher judged the student's tokens
        assert records[-1]["distill/tokens"] > 0 and "distill/reverse_kl" in records[-1]
    if tools:
        for key in ("env/tool/calls", "env/tool/calls_per_episode", "eval/tool/calls",
                    "render/skipped"):
            assert key in records[-1], key


def test_the_long_horizon_recipe_continues_episodes_past_the_context(tmp_path):
    """configs/tiny_long_frozen_lake.py at tiny size with 5 turns: the whole history of an
    episode outgrows the 512-token context after 3 turns (a redrawn 8×8 board is ~120
    tokens), so its window policy continues the episodes as new samples, end to end."""
    out = str(tmp_path / "long")
    args = [a.replace(".max_turns=2", ".max_turns=5")
            for a in tiny_overrides("tiny_long_frozen_lake", out)]
    assert train.main(["train", *args]) == 0
    records = check_outputs(out, 2)
    for r in records:
        assert r["rollout/history_rewrites"] > 0 and r["rollout/samples_per_episode"] > 1
        assert r["rollout/history_tokens_dropped"] > 0 and r["env/truncated_by_length"] == 0
        assert r["env/num_turns"] > 3  # more than the full history holds
        # The re-prefilled rows sample what the learner recomputes on the new streams.
        assert r["rollout/logprob_mismatch"] < 1e-2
    assert records[-1]["eval/samples_per_episode"] > 1


def check_elo_table(out, capsys):
    """scripts/analysis/selfplay_elo.py over the run: the start, both checkpoints and
    random, every pair's games played and counted."""
    capsys.readouterr()
    script = load_script("scripts/analysis/selfplay_elo.py")
    assert script.main(["--run", out, "--games", "2"]) == 0
    lines = [json.loads(line) for line in capsys.readouterr().out.splitlines()]
    players = [r for r in lines if "player" in r]
    assert [r["player"] for r in players] == ["start", "step_1", "step_2", "random"]
    assert [r["step"] for r in players] == [0, 1, 2, None]
    pairs = [r for r in lines if "a" in r]
    assert len(pairs) == 6 and all(r["wins"] + r["draws"] + r["losses"] == 2 for r in pairs)
    assert all(r["games"] == 6 for r in players)
