"""Where a training run's files are, told from a path alone (nothing is loaded): whether a
path names a run, the run's `config.json`, and why a path cannot name a distillation
teacher. Config validation reads these, so they sit below the loaders
(`run_loading.py`) and the pipeline."""

from __future__ import annotations

import json
import os

from jaxrl_agentic.runtime.checkpoint import CheckpointError


def find_run_config(checkpoint_path: str) -> str:
    """The `config.json` of the run a checkpoint path belongs to (searched upwards)."""
    path = os.path.abspath(os.path.expanduser(checkpoint_path))
    for _ in range(4):
        candidate = os.path.join(path, "config.json")
        if os.path.exists(candidate) and os.path.isdir(os.path.join(path, "checkpoints")):
            return candidate
        path = os.path.dirname(path)
    raise CheckpointError(f"no run config.json found above {checkpoint_path}")


def is_run_path(path: str) -> bool:
    """Whether `path` is a training run's output directory, its `checkpoints` directory or
    one step's directory inside it (not a Hugging Face model directory)."""
    path = os.path.abspath(os.path.expanduser(path))
    parent = os.path.basename(os.path.dirname(path))
    return (os.path.isdir(os.path.join(path, "checkpoints"))
            or os.path.basename(path) == "checkpoints"
            or (os.path.basename(path).isdigit() and parent == "checkpoints"))


def run_setting(path: str, key: str, default):
    """One flat setting of the run a path belongs to, as its `config.json` stored it
    (`default` for a run written before the setting existed)."""
    with open(find_run_config(path)) as f:
        return json.load(f).get(key, default)


def is_teacher_run(source: str) -> bool:
    """Whether a teacher `source` names a training run (not a built-in model name)."""
    from jaxrl_agentic.models.tiny import PRETRAINED_NAMES

    return source not in PRETRAINED_NAMES and is_run_path(source)


def teacher_source_problem(source: str) -> str | None:
    """Why ``source`` cannot name a teacher (checked without reading weights), or None."""
    from jaxrl_agentic.models.sources import source_problem
    from jaxrl_agentic.models.tiny import PRETRAINED_NAMES

    if source in PRETRAINED_NAMES:
        return None
    if is_teacher_run(source):
        try:
            find_run_config(source)
        except CheckpointError as e:
            return str(e)
        return None
    problem = source_problem(source)
    return problem and (f"{problem} (a Hugging Face directory, a .gguf file, a packaged "
                        "model's name, 'tiny', 'tiny-tools', or a training run's output "
                        "directory)")
