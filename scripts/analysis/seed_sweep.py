"""Does a recipe learn on every seed? Trains it once per seed and prints one JSON line.

    python scripts/analysis/seed_sweep.py --config configs/frozen_lake.py --seeds 0-4 \
        [--budget-min 20] [--target 0.8] [--parallel 1] [--out /tmp/sweep] \
        [--stop-at-target] [--gain 0.3] [--config.<key>=<value> ...]

Each seed is one `python -m jaxrl_agentic.train` process (`--config.seed=S`, its own
`output_dir`), so the runs are exactly what a user gets. Different seeds diverge the way
different CPUs' rounding does (both change which tokens are sampled), which makes a sweep on
one machine the test of "learns on any machine".

Per seed, from the run's `metrics.jsonl` (`eval/success` every `eval_steps`; `time/elapsed`
is the wall time since the run started, model build and format warm-up included):

- `curve`: [step, minutes, eval success] at every eval within the budget;
- `reached_step` / `reached_min`: the first eval at or above `--target` within the budget
  (null if none); `success_at_budget`: the last eval within the budget; `best`;
- `late_mean`: the mean of the last three evals within the budget (does it stay there?).

A run is stopped when its wall time passes `--budget-min` (plus one minute for the eval in
flight), so a sweep costs at most seeds × budget / parallel. `--stop-at-target` also stops
it at its first eval at or above `--target` (exit "reached"): a sweep that only asks "does
every seed get there in time" then costs the sum of the times to get there, and
`success_at_budget` / `late_mean` describe the curve up to that eval. `--parallel N` runs N seeds at
once, each pinned to its own share of the cores (`os.sched_setaffinity`): with N = the core
count every run has one core, a stricter test of "within the budget" than the whole machine.
The summary line: `all_reached` (every seed hit the target in time), the min/median/max of
`success_at_budget`, and the cores each run had. `--gain G` replaces `--target` by each run's
own first eval + G ("raises held-out success by G"; the first eval itself never counts).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def parse_seeds(text: str) -> list[int]:
    """"0-4" → [0, 1, 2, 3, 4]; "0,3,7" → [0, 3, 7]."""
    seeds: list[int] = []
    for part in text.split(","):
        lo, sep, hi = part.partition("-")
        seeds.extend(range(int(lo), int(hi) + 1) if sep else [int(lo)])
    return seeds


def read_evals(path: str) -> list[tuple[int, float, float]]:
    """[(step, elapsed seconds, eval/success)] from a run's metrics.jsonl, in step order."""
    if not os.path.exists(path):
        return []
    evals = []
    with open(path) as f:
        for line in f:
            record = json.loads(line)
            if "eval/success" in record:
                evals.append((int(record["step"]), float(record.get("time/elapsed", 0.0)),
                              float(record["eval/success"])))
    return sorted(evals)


def summarize(evals: list[tuple[int, float, float]], budget_s: float,
              target: float, gain: float | None = None) -> dict:
    """One seed's curve summary (module docstring), from `read_evals`'s list. With `gain`
    the target is the run's own first eval + `gain` (`--gain`)."""
    within = [e for e in evals if e[1] <= budget_s]
    candidates = within
    if gain is not None:  # the first eval is the baseline, never its own gain
        target = within[0][2] + gain if within else float("inf")
        candidates = within[1:]
    reached = next((e for e in candidates if e[2] >= target), None)
    values = [e[2] for e in within]
    return {
        "first_eval": values[0] if values else None,
        "target": round(target, 4) if values else None,
        "curve": [[step, round(sec / 60, 2), round(value, 4)] for step, sec, value in within],
        "reached_step": reached[0] if reached else None,
        "reached_min": round(reached[1] / 60, 2) if reached else None,
        "success_at_budget": values[-1] if values else None,
        "best": max(values) if values else None,
        "late_mean": round(statistics.fmean(values[-3:]), 4) if values else None,
        "last_step_in_budget": within[-1][0] if within else None,
    }


def core_sets(parallel: int) -> list[set[int]]:
    """The available cores split into `parallel` disjoint sets (round robin)."""
    cores = sorted(os.sched_getaffinity(0))
    if parallel > len(cores):
        raise SystemExit(f"error: --parallel {parallel} exceeds the {len(cores)} available cores")
    return [set(cores[i::parallel]) for i in range(parallel)]


def launch(config: str, seed: int, out: str, overrides: list[str], cores: set[int]):
    run_dir = os.path.join(out, f"seed{seed}")
    os.makedirs(run_dir, exist_ok=True)
    metrics = os.path.join(run_dir, "metrics.jsonl")
    if os.path.exists(metrics):  # a fresh curve, not one appended to an earlier sweep's
        os.remove(metrics)
    cmd = [sys.executable, "-m", "jaxrl_agentic.train", "--config", config,
           f"--config.seed={seed}", f"--config.output_dir={run_dir}", *overrides]
    log = open(os.path.join(run_dir, "train.log"), "w")  # noqa: SIM115 - closed by the caller
    proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, cwd=ROOT,
                            preexec_fn=lambda: os.sched_setaffinity(0, cores))
    return {"seed": seed, "proc": proc, "log": log, "start": time.monotonic(),
            "metrics": metrics, "cores": cores}


def run_jobs(jobs: list[dict], free: list[set[int]], budget_s: float, *,
             stop_at_target: bool, poll_s: float = 5.0) -> dict:
    """Runs `jobs` (dicts with `key`, `config`, `seed`, `out`, `overrides`, `target` and
    `gain` as `summarize` takes them; optionally a `label` for the progress line), one per
    core set of `free` at a time, looking at them every `poll_s` seconds; returns
    {key: summary}."""
    pending, running, results = list(jobs), [], {}
    while pending or running:
        while pending and free:
            spec = pending.pop(0)
            job = launch(spec["config"], spec["seed"], spec["out"], spec["overrides"],
                         free.pop(0))
            running.append({**job, "spec": spec})
        time.sleep(poll_s)  # a polling loop over minutes-long runs
        for job in list(running):
            spec = job["spec"]
            proc, over = job["proc"], time.monotonic() - job["start"] > budget_s + 60
            summary = summarize(read_evals(job["metrics"]), budget_s, spec["target"],
                                spec["gain"])
            reached = stop_at_target and summary["reached_step"] is not None
            if proc.poll() is None:
                if not (over or reached):
                    continue
                proc.terminate()
                proc.wait()
            job["log"].close()
            summary["exit"] = "reached" if reached else "budget" if over else proc.returncode
            results[spec["key"]] = summary
            running.remove(job)
            free.append(job["cores"])
            print(f"{spec.get('label', spec['key'])}: {json.dumps(summary)}", file=sys.stderr,
                  flush=True)
    return results


def run_all(args, overrides: list[str], free: list[set[int]],
            poll_s: float = 5.0) -> dict[int, dict]:
    """Runs every seed of `args.config` (`run_jobs`); returns per-seed summaries."""
    jobs = [{"key": seed, "label": f"seed {seed}", "config": args.config, "seed": seed,
             "out": args.out, "overrides": overrides, "target": args.target, "gain": args.gain}
            for seed in parse_seeds(args.seeds)]
    return run_jobs(jobs, free, args.budget_min * 60, stop_at_target=args.stop_at_target,
                    poll_s=poll_s)


def parse_with_overrides(parser: argparse.ArgumentParser):
    """(args, the `--config.<key>=<value>` recipe overrides); anything else is an error."""
    args, overrides = parser.parse_known_args()
    bad = [o for o in overrides if not o.startswith("--config.")]
    if bad:
        parser.error(f"unrecognised argument {bad[0]} (recipe overrides are --config.<key>=v)")
    return args, overrides


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--config", required=True)
    parser.add_argument("--seeds", default="0-4")
    parser.add_argument("--budget-min", type=float, default=20.0)
    parser.add_argument("--target", type=float, default=0.8)
    parser.add_argument("--parallel", type=int, default=1)
    parser.add_argument("--out", default="outputs/seed_sweep")
    parser.add_argument("--stop-at-target", action="store_true",
                        help="stop each run at its first eval at or above --target")
    parser.add_argument("--gain", type=float, default=None,
                        help="instead of --target: each run's first eval + GAIN")
    args, overrides = parse_with_overrides(parser)
    started = time.monotonic()
    core_split = core_sets(args.parallel)
    cores_per_run = len(core_split[0])
    results = run_all(args, overrides, core_split)
    finals = [r["success_at_budget"] or 0.0 for r in results.values()]
    print(json.dumps({
        "config": args.config, "overrides": overrides, "budget_min": args.budget_min,
        "target": args.target if args.gain is None else f"first eval + {args.gain}",
        "cores_per_run": cores_per_run,
        "stop_at_target": args.stop_at_target,
        "all_reached": all(r["reached_step"] is not None for r in results.values()),
        "reached": sum(r["reached_step"] is not None for r in results.values()),
        "success_at_budget": {"min": min(finals), "median": statistics.median(finals),
                              "max": max(finals)},
        "seeds": {str(s): results[s] for s in sorted(results)},
        "total_min": round((time.monotonic() - started) / 60, 1),
    }))


if __name__ == "__main__":
    main()
