"""Evaluate a checkpoint on the held-out validation seeds:

    python -m jaxrl_agentic.evaluate --config configs/<recipe>.py --checkpoint RUN/checkpoints

Prints one JSON line of `eval/*` metrics (`val_env_manager` episodes, greedy unless
`eval_temperature` > 0).
"""

from __future__ import annotations

import json
import sys

from jaxrl_agentic.config import ConfigError


def evaluate_checkpoint(argv: list[str], checkpoint_path: str):
    """(pipeline, eval metrics, eval trajectories) of a checkpoint. `argv` as
    `train.parse_config` takes it: [program, --config=RECIPE, --config.<key>=<value>, ...]."""
    from jaxrl_agentic.config import validate
    from jaxrl_agentic.run_loading import restore_pipeline
    from jaxrl_agentic.train import parse_config

    c = parse_config(argv)
    validate(c)
    pipeline = restore_pipeline(c, checkpoint_path)
    metrics, trajs = pipeline.evaluate()
    return pipeline, metrics, trajs


def main(argv=None) -> int:
    from jaxrl_agentic.models import CheckpointError as ModelError
    from jaxrl_agentic.runtime.checkpoint import CheckpointError
    from jaxrl_agentic.train import EXIT_BAD_INPUT

    argv = list(sys.argv if argv is None else argv)
    checkpoint = None
    rest = [argv[0]]
    for arg in argv[1:]:
        if arg.startswith("--checkpoint="):
            checkpoint = arg.split("=", 1)[1]
        else:
            rest.append(arg)
    if "--checkpoint" in rest:
        i = rest.index("--checkpoint")
        checkpoint = rest[i + 1] if i + 1 < len(rest) else None
        del rest[i : i + 2]
    try:
        if not checkpoint:
            raise ConfigError("--checkpoint is required (a run's checkpoints dir or one step)")
        pipeline, metrics, _ = evaluate_checkpoint(rest, checkpoint)
    except (ConfigError, ModelError, CheckpointError) as e:
        print(f"error: {e}", file=sys.stderr)
        return EXIT_BAD_INPUT
    print(json.dumps({"step": pipeline.step, **metrics}, sort_keys=True))
    return 0


if __name__ == "__main__":
    sys.exit(main())
