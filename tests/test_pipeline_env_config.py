"""A manager's `env_config` overrides: the training maps can differ from the held-out ones
(configs/frozen_lake.py trains on p_frozen 0.7 and evaluates on the standard 0.8)."""

import os
import re

import pytest

from jaxrl_agentic import train
from jaxrl_agentic.config import ConfigError, env_manager
from jaxrl_agentic.run_config import build_run_config
from jaxrl_agentic.warmup import warmup_cache_key, warmup_envs

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
BOARD_ROW = re.compile(r"^[_OPGX√](?: [_OPGX√]){3}$")


def small_config(out: str, *overrides: str):
    return train.parse_config([
        "train", f"--config={os.path.join(ROOT, 'configs', 'frozen_lake.py')}",
        f"--config.output_dir={out}", "--config.pretrain=tiny", "--config.format_warmup.steps=0",
        "--config.custom_envs.frozen_lake.max_turns=1",
        "--config.train_env_manager.num_env_groups=8",
        "--config.train_env_manager.group_size=2",
        "--config.val_env_manager.num_env_groups=16", *overrides])


def holes_on_first_board(pipeline, traj) -> int:
    prompt = pipeline.formatter.tokenizer.decode(traj.tokens[:traj.turns[0].context_len])
    rows = [line for line in prompt.splitlines() if BOARD_ROW.match(line.strip())]
    assert len(rows) == 4, prompt
    return sum(row.count("O") for row in rows)


def test_manager_env_config_overrides_the_tag_for_that_split_only():
    c = small_config("/tmp/unused")
    cfg = build_run_config(c)
    assert cfg.split_env_config("train", "frozen_lake")["p_frozen"] == 0.7
    assert "p_frozen" not in cfg.split_env_config("val", "frozen_lake")
    # Every other parameter is the tag's, for both splits.
    for split in ("train", "val"):
        merged = cfg.split_env_config(split, "frozen_lake")
        assert merged["hole_penalty"] == c.custom_envs.frozen_lake.env_config.hole_penalty
    assert env_manager(2, 2).env_config.to_dict() == {}


def test_warmup_plays_the_training_maps_too_and_its_cache_key_sees_them():
    c = small_config("/tmp/unused")
    envs = warmup_envs(build_run_config(c))
    assert [tag for tag, _ in envs] == ["frozen_lake", "frozen_lake"]
    assert "p_frozen" not in envs[0][1] and envs[1][1]["p_frozen"] == 0.7
    plain = small_config("/tmp/unused", "--config.train_env_manager.env_config.p_frozen=0.8")
    assert warmup_cache_key("/m", build_run_config(c)) != \
        warmup_cache_key("/m", build_run_config(plain))
    c.train_env_manager.env_config = {}
    assert warmup_envs(build_run_config(c)) == envs[:1]


def test_training_episodes_are_drawn_with_the_override_and_eval_without(tmp_path):
    """Train maps at p_frozen 0.3 against held-out maps at the tag's 0.8: ~9.8 holes on the
    14 free cells against ~2.8 (the counts are read from the rendered first prompt)."""
    from jaxrl_agentic.pipeline import Pipeline

    pipeline = Pipeline(small_config(str(tmp_path),
                                     "--config.train_env_manager.env_config.p_frozen=0.3"))
    train_trajs = pipeline.rollout("train")
    val_trajs = pipeline.rollout("val", greedy=True)
    train_holes = [holes_on_first_board(pipeline, t) for t in train_trajs]
    val_holes = [holes_on_first_board(pipeline, t) for t in val_trajs]
    assert sum(train_holes) / len(train_holes) > 6.0, train_holes
    assert sum(val_holes) / len(val_holes) < 4.5, val_holes
    # The tag itself is unchanged: a replay of an eval episode draws its map at 0.8.
    assert float(pipeline.runners["frozen_lake"].env_params.p_frozen) == pytest.approx(0.8)
    assert float(pipeline.split_runners["train"]["frozen_lake"].env_params.p_frozen) \
        == pytest.approx(0.3)


def test_an_unknown_override_names_the_manager_field(tmp_path):
    from jaxrl_agentic.pipeline import Pipeline

    c = small_config(str(tmp_path))
    c.train_env_manager.env_config = {"p_frozn": 0.7}
    with pytest.raises(ConfigError, match=r"config\.train_env_manager\.env_config: frozen_lake: "
                                          r"unknown parameter 'p_frozn'"):
        Pipeline(c)


def test_an_unknown_override_fails_before_the_format_warmup_trains(tmp_path):
    from jaxrl_agentic.warmup import format_warmup

    c = small_config(str(tmp_path), "--config.format_warmup.steps=1")
    c.train_env_manager.env_config = {"p_frozn": 0.7}
    with pytest.raises(ConfigError, match=r"config\.train_env_manager\.env_config: frozen_lake: "
                                          r"unknown parameter 'p_frozn'"):
        format_warmup(build_run_config(c).model.directory(), c, str(tmp_path / "warm"),
                      log=lambda *_: None)
