"""Export a checkpoint's policy as a Hugging Face model directory:

    python -m jaxrl_agentic.export --checkpoint RUN/checkpoints[/STEP] --out DIR

The run's config.json (written by training beside `checkpoints/`) says which model and
tokenizer the parameters belong to; `transformers` loads the result.
"""

from __future__ import annotations

import argparse
import sys


def main(argv=None) -> int:
    from jaxrl_agentic.config import ConfigError
    from jaxrl_agentic.models import CheckpointError as ModelError
    from jaxrl_agentic.models import save_pretrained
    from jaxrl_agentic.run_loading import load_run_config, restore_pipeline
    from jaxrl_agentic.runtime.checkpoint import CheckpointError

    parser = argparse.ArgumentParser(prog="python -m jaxrl_agentic.export",
                                     description=__doc__.splitlines()[0])
    parser.add_argument("--checkpoint", required=True)
    parser.add_argument("--out", required=True)
    args = parser.parse_args(argv)
    try:
        c = load_run_config(args.checkpoint)
        pipeline = restore_pipeline(c, args.checkpoint)
        save_pretrained(pipeline.export_model(), pipeline.tokenizer, args.out)
    except (ConfigError, ModelError, CheckpointError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    print(args.out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
