"""One JAX device per core against one device, side by side: whole pipeline steps on CPU.

    python scripts/bench/bench_cpu_devices.py [--rounds 2] [--steps 6] [--warmup-steps 3]
        [--config configs/frozen_lake.py] [--config.<key>=<value> ...]

Runs ``bench_pipeline.py`` (same recipe, same overrides, same seeds) as a fresh process per
run, because a process' CPU device count is fixed once the JAX backend starts: once with
``mesh.cpu_devices=1`` (one device; XLA's intra-op thread pool splits each program over
the cores) and once with ``mesh.cpu_devices=0`` (one device per core; the batch rows are
split over them, each device runs its shard of a program). Rounds alternate the order
(ABBA…) so a drift in the machine's load hits both; every run shares one persistent
compilation cache so only the first run of each setting pays for compilation in full.

Prints one JSON line: per setting the per-run means of the step time and of the buckets
that move (``learner``, the rollout's prefill/decode, the rest), their medians over the
rounds, and ``speedup`` = one-device step time / per-core step time (medians), with
``learner_speedup`` the same for the learner bucket alone. Both settings play the same
episodes only up to rounding: the sharded update sums gradients in another order.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
SETTINGS = {"one_device": 1, "per_core": 0}


def run_once(cpu_devices: int, args, overrides: list[str], cache: str) -> dict:
    """One bench_pipeline.py process; its JSON line."""
    cmd = [sys.executable, os.path.join(ROOT, "scripts", "bench", "bench_pipeline.py"),
           "--config", args.config, "--steps", str(args.steps),
           "--warmup-steps", str(args.warmup_steps), "--compilation-cache", cache,
           *overrides, f"--config.mesh.cpu_devices={cpu_devices}"]
    proc = subprocess.run(cmd, capture_output=True, text=True, cwd=ROOT)
    if proc.returncode != 0:
        raise SystemExit(f"bench_pipeline.py failed (cpu_devices={cpu_devices}):\n"
                         f"{proc.stderr[-3000:]}")
    return json.loads(proc.stdout.strip().splitlines()[-1])


def summary(run: dict) -> dict:
    buckets = run["bucket_s"]
    rollout = sum(v for k, v in buckets.items() if k.startswith("rollout/"))
    return {"step_s": run["step_s"], "learner_s": buckets.get("learner", 0.0),
            "rollout_s": round(rollout, 4),
            "rest_s": round(run["step_s"] - buckets.get("learner", 0.0) - rollout, 4),
            "devices": run["cpu_devices"]["devices"],
            "tokens_real_per_step": run["per_step"]["tokens_real"],
            "new_compilations_after_warmup": run["new_compilations_after_warmup"]}


def compare(runs: dict[str, list[dict]]) -> dict:
    """Medians per setting and the ratios one_device / per_core."""
    med = {name: {key: statistics.median(r[key] for r in rs)
                  for key in ("step_s", "learner_s", "rollout_s", "rest_s")}
           for name, rs in runs.items()}
    one, per = med["one_device"], med["per_core"]
    return {"median": med,
            "speedup": round(one["step_s"] / per["step_s"], 3),
            "learner_speedup": round(one["learner_s"] / per["learner_s"], 3),
            "rollout_speedup": round(one["rollout_s"] / per["rollout_s"], 3)}


def main(argv=None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--config", default=os.path.join(ROOT, "configs", "frozen_lake.py"))
    parser.add_argument("--rounds", type=int, default=2, help="runs per setting")
    parser.add_argument("--steps", type=int, default=6)
    parser.add_argument("--warmup-steps", type=int, default=3)
    args, overrides = parser.parse_known_args(argv)
    bad = [a for a in overrides if not a.startswith("--config.") or "cpu_devices" in a]
    if bad:
        parser.error(f"unrecognised or conflicting arguments: {' '.join(bad)}")
    load_before = os.getloadavg()[0]
    runs: dict[str, list[dict]] = {name: [] for name in SETTINGS}
    with tempfile.TemporaryDirectory(prefix="bench_cpu_devices_") as cache:
        for i in range(args.rounds):
            order = list(SETTINGS) if i % 2 == 0 else list(SETTINGS)[::-1]
            for name in order:
                runs[name].append(summary(run_once(SETTINGS[name], args, overrides, cache)))
                print(f"round {i}: {name} {runs[name][-1]['step_s']:.2f} s/step",
                      file=sys.stderr)
    result = {"config": os.path.relpath(args.config, ROOT), "overrides": overrides,
              "cores": len(os.sched_getaffinity(0)), "rounds": args.rounds,
              "steps": args.steps, "warmup_steps": args.warmup_steps, **compare(runs),
              "runs": runs, "loadavg_1m": [round(load_before, 2), round(os.getloadavg()[0], 2)],
              "timing": "bench_pipeline.py step means after warm-up, one process per run, "
                        "settings alternated ABBA; medians over rounds"}
    print(json.dumps(result))
    return result


if __name__ == "__main__":
    main()
