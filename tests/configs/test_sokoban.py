"""The Sokoban recipe can learn: after its format warm-up the first RL step has signal."""

import os

import numpy as np

from jaxrl_agentic.pipeline import Pipeline
from jaxrl_agentic.train import parse_config

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def test_first_rl_step_after_the_warm_up_has_valid_actions_and_a_gradient(tmp_path):
    # The recipe as it is (warm-up, env, lengths: the warmed model is the one a run of the
    # recipe caches and reuses), with fewer episodes per step.
    c = parse_config(["train", f"--config={os.path.join(ROOT, 'configs', 'sokoban.py')}",
                      f"--config.output_dir={tmp_path}",
                      "--config.train_env_manager.num_env_groups=2",
                      "--config.train_env_manager.group_size=4",
                      "--config.mini_batch_size=8",
                      "--config.max_steps=1"])
    assert c.format_warmup.steps > 0
    pipe = Pipeline(c)
    try:
        metrics, trajs, samples = pipe.train_step()
    finally:
        pipe.close()
    assert metrics["env/action_is_valid"] > 0
    advantages = np.concatenate([s.advantages[s.loss_mask > 0] for s in samples])
    assert np.abs(advantages).max() > 0
    assert metrics["actor/grad_norm"] > 0
