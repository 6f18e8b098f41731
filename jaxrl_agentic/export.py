"""Export a checkpoint's policy as a Hugging Face model directory:

    python -m jaxrl_agentic.export --checkpoint RUN/checkpoints[/STEP] --out DIR [--adapter]

The run's config.json (written by training beside `checkpoints/`) says which model and
tokenizer the parameters belong to; `transformers` loads the result. A LoRA run exports its
adapters merged into the weights (W + s·A·B), or with `--adapter` the adapters alone as a
PEFT directory, which `peft.PeftModel.from_pretrained` loads onto the run's base model.
"""

from __future__ import annotations

import argparse
import sys


def main(argv=None) -> int:
    from jaxrl_agentic.config import ConfigError
    from jaxrl_agentic.models import CheckpointError as ModelError
    from jaxrl_agentic.models import save_pretrained
    from jaxrl_agentic.models.hf_io import save_peft_adapter
    from jaxrl_agentic.run_loading import load_run_config, restore_pipeline
    from jaxrl_agentic.runtime.checkpoint import CheckpointError

    parser = argparse.ArgumentParser(prog="python -m jaxrl_agentic.export",
                                     description=__doc__.splitlines()[0])
    parser.add_argument("--checkpoint", required=True)
    parser.add_argument("--out", required=True)
    parser.add_argument("--adapter", action="store_true",
                        help="LoRA runs: the adapters alone, as a PEFT directory")
    args = parser.parse_args(argv)
    try:
        c = load_run_config(args.checkpoint)
        if args.adapter and not c.get("lora_rank", 0):
            raise ConfigError("--adapter: the run was not trained with LoRA (lora_rank = 0)")
        pipeline = restore_pipeline(c, args.checkpoint)
        if args.adapter:
            save_peft_adapter(pipeline.adapted_model(), args.out, pipeline.model_dir)
        else:
            save_pretrained(pipeline.export_model(), pipeline.tokenizer, args.out)
    except (ConfigError, ModelError, CheckpointError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    print(args.out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
