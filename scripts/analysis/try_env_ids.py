"""Do environments the recipe was not tuned for run? One short training run per id, one JSON
line per id with its first eval.

    python scripts/analysis/try_env_ids.py --config configs/textarena.py \
        --ids textarena:GuessTheNumber-v0,textarena:TowerOfHanoi-v0 [--steps 1] \
        [--config.<key>=<value> ...]

Each id is one `python -m jaxrl_agentic.train` process with `--config.env_id=<id>`, `steps`
RL steps (default 1) and an eval after the last one, no format warm-up, and the recipe's
environment-specific settings cleared (`game_kwargs` / `dataset_config` of its only tag set
to `{}`, so each game or dataset runs with its own defaults). Printed per id: the exit
status, the last step's `eval/success`, `eval/action_is_valid`, `eval/num_turns`,
`env/truncated_by_length` and the wall minutes; a run that fails prints its last log line.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
KEYS = ("eval/success", "eval/action_is_valid", "eval/num_turns", "eval/truncated_by_length",
        "env/success")
# Per-environment settings of the recipes' only tag that another id must not inherit.
CLEARED = ("game_kwargs", "dataset_config")


def recipe_tag(config: str) -> tuple[str, dict]:
    """(the only env tag of the recipe, its env_config)."""
    sys.path.insert(0, ROOT)
    from jaxrl_agentic.config import recipe_config

    c = recipe_config(config)
    (tag,) = list(c.custom_envs)
    return tag, c.custom_envs[tag].env_config.to_dict()


def try_id(config: str, env_id: str, steps: int, overrides: list[str], out: str) -> dict:
    tag, env_config = recipe_tag(config)
    cleared = [f"--config.custom_envs.{tag}.env_config.{k}={{}}" for k in CLEARED
               if k in env_config]
    cmd = [sys.executable, "-m", "jaxrl_agentic.train", "--config", config,
           f"--config.env_id={env_id}", f"--config.output_dir={out}",
           f"--config.max_steps={steps}", f"--config.eval_steps={steps}",
           f"--config.save_steps={steps}", "--config.format_warmup.steps=0",
           *cleared, *overrides]
    started = time.monotonic()
    proc = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True)
    row = {"env_id": env_id, "exit": proc.returncode,
           "minutes": round((time.monotonic() - started) / 60, 2)}
    metrics = os.path.join(out, "metrics.jsonl")
    if proc.returncode == 0 and os.path.exists(metrics):
        with open(metrics) as f:
            last = json.loads(f.readlines()[-1])
        row.update({k: round(last[k], 4) for k in KEYS if k in last})
    else:
        lines = (proc.stderr or proc.stdout).strip().splitlines()
        row["error"] = lines[-1] if lines else ""
    return row


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--config", required=True)
    parser.add_argument("--ids", required=True, help="comma-separated env ids")
    parser.add_argument("--steps", type=int, default=1)
    args, overrides = parser.parse_known_args()
    bad = [o for o in overrides if not o.startswith("--config.")]
    if bad:
        parser.error(f"unrecognised argument {bad[0]} (recipe overrides are --config.<key>=v)")
    for env_id in args.ids.split(","):
        with tempfile.TemporaryDirectory() as out:
            print(json.dumps(try_id(args.config, env_id, args.steps, overrides, out)),
                  flush=True)


if __name__ == "__main__":
    main()
