"""Rebuild a training run from its output directory (config.json + orbax checkpoints)."""

from __future__ import annotations

import json
import os

import ml_collections

from jaxrl_agentic.run_config import as_run_config
from jaxrl_agentic.run_paths import find_run_config
from jaxrl_agentic.runtime.checkpoint import Checkpointer, resolve_checkpoint

# Fields keyed by the user's own names (env tags): a run's are all it has, none is added.
_USER_KEYED = ("custom_envs", "env_specific")


def load_run_config(checkpoint_path: str) -> ml_collections.ConfigDict:
    """The run's flat config, as its config.json stored it; a field the run's version of
    the trainer did not have yet (e.g. `teacher`, `distill_center`) takes its default, so an
    older run still loads (as a teacher, for evaluation, export or play)."""
    from jaxrl_agentic.config import default_config

    with open(find_run_config(checkpoint_path)) as f:
        stored = json.load(f)
    for key, default in default_config().to_dict().items():
        if key not in stored:
            stored[key] = default
        elif isinstance(default, dict) and key not in _USER_KEYED:
            stored[key] = {**default, **stored[key]}
    return ml_collections.ConfigDict(stored)


def restore_pipeline(c, checkpoint_path: str):
    """A Pipeline for config `c` (flat or a :class:`RunConfig`) with the learner state of
    the given checkpoint."""
    from jaxrl_agentic.pipeline import Pipeline

    cfg = as_run_config(c)
    directory, step = resolve_checkpoint(checkpoint_path, cfg.run.output_dir)
    pipeline = Pipeline(cfg, run_policy=run_policy)
    states, host = Checkpointer(directory).restore(step, pipeline.train_states())
    pipeline.load_train_states(states)
    pipeline.load_host_state(host)
    return pipeline


def run_policy(path: str):
    """(model, tokenizer) of a run's policy at its latest checkpoint, or at the step that
    `path` names; a LoRA run's adapters come merged into the weights, as export writes
    them. `path`: as `is_run_path` accepts it."""
    c = load_run_config(path)
    if os.path.isdir(os.path.join(path, "checkpoints")):
        path = os.path.join(path, "checkpoints")
    pipeline = restore_pipeline(c, path)
    try:
        return pipeline.export_model(), pipeline.tokenizer
    finally:
        pipeline.close()
