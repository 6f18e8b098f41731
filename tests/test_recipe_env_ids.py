"""`--config.env_id=<id>` alone puts another game or dataset on the third-party recipes:
the settings tuned for the recipe's own environment stay with it (`env_specific.py`), so
each other id resolves to a valid config whose environment builds, resets and takes a
reply. No model is built: validation and the typed tree are what a run reads first."""

import os
import random

import pytest

from jaxrl_agentic import train
from jaxrl_agentic.config import (
    ConfigError,
    default_config,
    env_specific_settings,
    resolve_env_specific,
    validate,
)
from jaxrl_agentic.envs.python_env import PyStep, make_python_env
from jaxrl_agentic.rollout.groups import EpisodeSpec
from jaxrl_agentic.run_config import build_run_config
from jaxrl_agentic.warmup import text_policy
from tests.test_train import ROOT

TEXTARENA, REASONING_GYM, SELFPLAY = (os.path.join(ROOT, "configs", f"{r}.py")
                                      for r in ("textarena", "reasoning_gym",
                                                "textarena_selfplay"))


def resolved(recipe: str, *overrides: str):
    c = train.parse_config(["train", f"--config={recipe}", *overrides])
    validate(c)
    return build_run_config(c)


@pytest.mark.parametrize("recipe, env_id, tag, cleared", [
    (TEXTARENA, "textarena:LightsOut-v0", "game", "game_kwargs"),
    (TEXTARENA, "textarena:Mastermind-v0", "game", "game_kwargs"),
    (REASONING_GYM, "reasoning_gym:gcd", "task", "dataset_config"),
    (REASONING_GYM, "reasoning_gym:propositional_logic", "task", "dataset_config"),
])
def test_another_id_is_one_override(recipe, env_id, tag, cleared):
    cfg = resolved(recipe, f"--config.env_id={env_id}")
    env = cfg.envs[tag]
    assert env.env_type == env_id and dict(env.env_config[cleared]) == {}
    if recipe == TEXTARENA:  # ThreeCardMonte's one-digit reply and cups are its own
        assert env.max_tokens_per_step == 8 and cfg.format_warmup.replies == ()
    env_config = cfg.split_env_config("train", tag)
    factory = make_python_env(env.env_type, format_penalty=env.format_penalty, **env_config)
    episode = factory(EpisodeSpec(seed=0, group_id=0, member=0), 0)
    text = episode.reset(0)
    assert isinstance(text, str) and text
    # A reply of the warm-up's policy for this id, as the run's format warm-up plays it.
    reply = text_policy(env.env_type, env_config)(random.Random(0))(text)
    assert isinstance(episode.step(reply), PyStep)


def test_the_recipes_own_id_keeps_what_was_tuned_for_it():
    for overrides in ((), ("--config.env_id=textarena:ThreeCardMonte-v0",)):
        cfg = resolved(TEXTARENA, *overrides)
        env = cfg.envs["game"]
        assert dict(env.env_config["game_kwargs"]) == {"steps": 0}
        assert env.max_tokens_per_step == 1
        assert cfg.format_warmup.replies == ("[0]", "[1]", "[2]")
    cfg = resolved(REASONING_GYM)
    assert cfg.envs["task"].env_config["dataset_config"]["operators"] == ("+", "-")


def test_an_override_of_a_tuned_field_wins_on_another_id():
    cfg = resolved(TEXTARENA, "--config.env_id=textarena:GuessTheNumber-v0",
                   "--config.custom_envs.game.env_config.game_kwargs={'max_number': 9}",
                   "--config.format_warmup.replies=('[3]', '[6]')",
                   "--config.custom_envs.game.max_tokens_per_step=4")
    env = cfg.envs["game"]
    assert dict(env.env_config["game_kwargs"]) == {"max_number": 9}
    assert env.max_tokens_per_step == 4
    assert cfg.format_warmup.replies == ("[3]", "[6]")


def test_any_recipe_can_mark_settings_as_its_environments_own():
    c = default_config()
    c.custom_envs.frozen_lake.max_turns = 5
    c.format_warmup.replies = ("<answer>Up</answer>",)
    env_specific_settings(c, "frozen_lake", {"custom_envs.frozen_lake.max_turns": 10,
                                             "format_warmup.replies": []})
    assert resolve_env_specific(c) is c  # its own environment: the fields as written
    for field, value in (("env_id", "sokoban"), ("custom_envs.frozen_lake.env_type", "sokoban")):
        other = c.copy_and_resolve_references()
        with other.unlocked():
            if field == "env_id":
                other.env_id = value
            else:
                other.custom_envs.frozen_lake.env_type = value
        r = resolve_env_specific(other)
        assert (r.custom_envs.frozen_lake.max_turns, r.format_warmup.replies) == (10, ())
        assert other.custom_envs.frozen_lake.max_turns == 5  # a copy: the input is unchanged
    # A tuned field the run changed keeps the change; the tuned replies as a list are the
    # same setting (an override may write either), so they still go.
    other = c.copy_and_resolve_references()
    other.env_id, other.custom_envs.frozen_lake.max_turns = "sokoban", 7
    other.format_warmup.replies = ["<answer>Up</answer>"]
    r = resolve_env_specific(other)
    assert (r.custom_envs.frozen_lake.max_turns, r.format_warmup.replies) == (7, ())
    with pytest.raises(ValueError, match="config.custom_envs.frozen_lake.max_turn is not"):
        env_specific_settings(c, "frozen_lake", {"custom_envs.frozen_lake.max_turn": 1})
    with pytest.raises(ValueError, match="'lake' is not in custom_envs"):
        env_specific_settings(c, "lake", {})


def test_a_tuned_value_the_field_cannot_take_is_a_config_error():
    c = default_config()
    env_specific_settings(c, "frozen_lake", {"custom_envs.frozen_lake.max_turns": "ten"})
    c.env_id = "sokoban"
    with pytest.raises(ConfigError, match="^config.env_specific: "):
        validate(c)


def test_another_two_player_game_is_one_override_on_the_self_play_recipe():
    """The recipe's three tags (self-play, against its start, against random) play one
    game: `env_id` replaces it on all three, and TicTacToe's one-token move budget stays
    TicTacToe's."""
    cfg = resolved(SELFPLAY, "--config.env_id=textarena:KuhnPoker-v0")
    assert sorted(cfg.envs) == ["game", "vs_random", "vs_start"]
    for tag, env in cfg.envs.items():
        assert env.env_type == "textarena:KuhnPoker-v0" and env.max_tokens_per_step == 8
        factory = make_python_env(env.env_type, **cfg.split_env_config("val", tag))
        match = factory(EpisodeSpec(seed=1, group_id=1, member=0), 0)
        match.start(1)
        assert "[check]" in match.observe()
    assert resolved(SELFPLAY).envs["game"].max_tokens_per_step == 1
    c = train.parse_config(["train", f"--config={TEXTARENA}",
                            "--config.env_id=textarena:KuhnPoker-v0"])
    with c.unlocked():
        c.custom_envs.other = dict(c.custom_envs.game.to_dict(), env_type="textarena:Nim-v0")
    with pytest.raises(ConfigError, match="^config.env_id: replaces the environment its "
                                          "tags all play; custom_envs plays"):
        validate(c)
