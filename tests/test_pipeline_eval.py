"""Pipeline.evaluate: greedy by default, sampled at `eval_temperature` when it is > 0."""

import dataclasses

import numpy as np
import pytest

from jaxrl_agentic.config import ConfigError, validate
from tests.test_pipeline_env_config import small_config


def replies(trajs):
    return [tuple(tuple(t.generated) for t in traj.turns) for traj in trajs]


def mean_logprob(trajs):
    return float(np.mean(np.concatenate([t.logprobs for traj in trajs for t in traj.turns])))


def with_eval_temperature(cfg, t: float):
    return dataclasses.replace(cfg, rollout=dataclasses.replace(cfg.rollout, eval_temperature=t))


def test_eval_temperature_samples_the_eval_replies(tmp_path):
    from jaxrl_agentic.pipeline import Pipeline

    pipeline = Pipeline(small_config(str(tmp_path)))
    assert pipeline.config.rollout.eval_temperature == 0.0
    _, greedy = pipeline.evaluate()
    assert replies(greedy) == replies(pipeline.rollout("val", greedy=True))

    pipeline.config = with_eval_temperature(pipeline.config, 0.5)
    _, half = pipeline.evaluate()
    assert replies(half) != replies(greedy)
    assert replies(pipeline.evaluate()[1]) == replies(half)  # same step: same noise
    # Logprobs are under the temperature distribution: sharper at 0.5 than at 1.
    pipeline.config = with_eval_temperature(pipeline.config, 1.0)
    _, one = pipeline.evaluate()
    assert mean_logprob(half) > mean_logprob(one)


def test_a_negative_eval_temperature_is_a_config_error(tmp_path):
    c = small_config(str(tmp_path), "--config.eval_temperature=-0.5")
    with pytest.raises(ConfigError, match=r"config\.eval_temperature: must be >= 0"):
        validate(c)
