"""Does on-policy distillation reach the teacher sooner than RL? One JSON line.

    python scripts/analysis/distill_sweep.py --rl-config configs/frozen_lake.py \
        --distill-config configs/tiny_distill_frozen_lake.py --teacher-steps 100 \
        --seeds 0-2 [--fraction 0.9] [--eval-steps 2] [--budget-min 30] [--parallel 2] \
        [--teacher DIR] [--out outputs/distill_sweep] [--distill-set KEY=VALUE ...] \
        [--config.<key>=<value> ...]

1. **Teacher**: the RL recipe on seed 0 for `--teacher-steps` steps (or `--teacher DIR`, an
   earlier run); its eval success at the last step is the teacher's score `s_T`.
2. **Both arms, each seed**: the RL recipe and the distillation recipe (teacher = that run)
   from the same start (the same format warm-up: the seed picks it), eval every
   `--eval-steps` steps, each stopped at its first eval ≥ `fraction · s_T` (the first eval,
   before any update, never counts).
3. **The bar**: per seed, distillation's steps to that target ≤ RL's / 3 (`--ratio`).

Each run is one `python -m jaxrl_agentic.train` process with its own output directory,
pinned to its own cores (`seed_sweep.run_jobs`). Steps, not minutes, are what the bar
compares (a distillation step also runs the teacher); the minutes are printed beside them.
`--config.<key>=<value>` overrides go to both arms, `--distill-set KEY=VALUE` to the
distillation arm only (a variant of its recipe).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from seed_sweep import (  # noqa: E402
    core_sets,
    launch,
    parse_seeds,
    parse_with_overrides,
    read_evals,
    run_jobs,
)


def train_teacher(config: str, steps: int, out: str, overrides: list[str],
                  cores: set[int]) -> str:
    """Trains the RL recipe on seed 0 for `steps` steps into `out`/teacher/seed0 (as
    `seed_sweep.launch` lays a run out); returns the directory."""
    job = launch(config, 0, os.path.join(out, "teacher"),
                 [f"--config.max_steps={steps}", *overrides], cores)
    rc = job["proc"].wait()
    job["log"].close()
    run_dir = os.path.dirname(job["metrics"])
    if rc != 0:
        raise SystemExit(f"error: the teacher's run exited {rc} (see {run_dir}/train.log)")
    return run_dir


def teacher_score(run_dir: str) -> tuple[int, float]:
    """(step, eval success) of the run's last eval."""
    evals = read_evals(os.path.join(run_dir, "metrics.jsonl"))
    if not evals:
        raise SystemExit(f"error: {run_dir}/metrics.jsonl has no eval/success")
    return evals[-1][0], evals[-1][2]


def bar_met(rl: dict, distill: dict, ratio: float) -> bool:
    """Distillation reached the target, in at most RL's steps / `ratio` (RL not reaching it
    within its budget counts as RL's last step in budget, a lower bound on what it needs)."""
    if distill["reached_step"] is None:
        return False
    rl_steps = rl["reached_step"] or rl["last_step_in_budget"]
    return rl_steps is not None and distill["reached_step"] * ratio <= rl_steps


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--rl-config", required=True)
    parser.add_argument("--distill-config", required=True)
    parser.add_argument("--teacher-steps", type=int, default=100)
    parser.add_argument("--teacher", default=None, help="an earlier run as the teacher")
    parser.add_argument("--seeds", default="0-2")
    parser.add_argument("--fraction", type=float, default=0.9)
    parser.add_argument("--ratio", type=float, default=3.0)
    parser.add_argument("--eval-steps", type=int, default=2)
    parser.add_argument("--budget-min", type=float, default=30.0)
    parser.add_argument("--parallel", type=int, default=1)
    parser.add_argument("--out", default="outputs/distill_sweep")
    parser.add_argument("--distill-set", action="append", default=[], metavar="KEY=VALUE",
                        help="an override of the distillation arm only")
    args, overrides = parse_with_overrides(parser)
    seeds = parse_seeds(args.seeds)
    started = time.monotonic()
    free = core_sets(args.parallel)
    out = os.path.abspath(args.out)
    teacher = os.path.abspath(args.teacher) if args.teacher else train_teacher(
        args.rl_config, args.teacher_steps, out, overrides, free[0])
    teacher_step, score = teacher_score(teacher)
    target = args.fraction * score
    common = [f"--config.eval_steps={args.eval_steps}", "--config.eval_before_training=True",
              *overrides]
    arms = {"rl": (args.rl_config, common),
            "distill": (args.distill_config, [f"--config.teacher.pretrain={teacher}", *common,
                                              *(f"--config.{kv}" for kv in args.distill_set)])}
    jobs = [{"key": (arm, seed), "label": f"{arm} seed {seed}", "config": config,
             "seed": seed, "out": os.path.join(out, arm), "overrides": arm_overrides,
             "target": target, "gain": None}
            for seed in seeds for arm, (config, arm_overrides) in arms.items()]
    results = run_jobs(jobs, free, args.budget_min * 60, stop_at_target=True)
    per_seed = {}
    for seed in seeds:
        rl, distill = results[("rl", seed)], results[("distill", seed)]
        per_seed[str(seed)] = {"rl": rl, "distill": distill,
                               "bar_met": bar_met(rl, distill, args.ratio)}
    print(json.dumps({
        "rl_config": args.rl_config, "distill_config": args.distill_config,
        "overrides": overrides, "distill_set": args.distill_set, "teacher": teacher,
        "teacher_step": teacher_step,
        "teacher_eval": score, "target": round(target, 4), "ratio": args.ratio,
        "eval_steps": args.eval_steps, "budget_min": args.budget_min,
        "cores_per_run": len(free[0]),
        "all_met": all(s["bar_met"] for s in per_seed.values()),
        "steps": {k: [s["rl"]["reached_step"], s["distill"]["reached_step"]]
                  for k, s in per_seed.items()},
        "seeds": per_seed, "total_min": round((time.monotonic() - started) / 60, 1),
    }))


if __name__ == "__main__":
    main()
