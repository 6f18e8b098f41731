"""Pipeline steps/s, synchronous (`async_generation_ratio=0`) vs asynchronous (`=--ratio`),
and with ``--in-flight`` vs in-flight weight updates (`in_flight_updates`, `max_policy_lag=--lag`).

Both pipelines are built in one process from the same config: the default recipe
(``configs/frozen_lake.py``, parsed by ``train.parse_config``, so any
``--config.<key>=<value>`` override passes through) at small sizes (tiny model, no format
warm-up, ``--groups`` × ``--group-size`` episodes of ``--max-turns`` turns, one optimizer
update per step), with the frozen lake played through the Python backend
(``custom_envs.frozen_lake.env_backend=python``) and ``env_config.step_delay_s =
--step-delay``: every env step sleeps that long, standing in for a slow tool call. The env
steps of one turn run concurrently on the runner's thread pool, so a rollout sleeps
≈ max_turns × step_delay (the random tiny policy never writes a valid action, so every
episode runs to ``max_turns``). The two modes differ in ``async_generation_ratio`` only.

    steps/s = N / wall time of N consecutive ``Pipeline.train_step()`` calls

Each pipeline first runs ``--warmup`` untimed steps (compilation). Then ``--rounds`` rounds
of ``--steps`` timed steps per mode, in ABBA order (round 1 sync → async, round 2
async → sync, ...) so that both modes see similar background load; the reported rate is
the median of the per-round rates. The asynchronous pipeline's producer thread runs ahead
of the learner, so each of its rounds is: one untimed lead-in step (starts the producer,
which begins the next rollout as soon as the learner takes this one: from then on the
two overlap as in a long run), the timed steps, then ``Pipeline.close()`` (joins the
producer after its in-flight rollout, so no rollout runs in the background while the
synchronous pipeline is timed; the next round restarts it from the pipeline's step, as a
resumed run does). ``ideal_ratio`` = (rollout + train) / max(rollout, train) from the
synchronous steps' own times: what perfect overlap of one rollout with one update would
give (the producer's sampler and the learner share the same CPU cores, so their compute does
not overlap for free).

``--in-flight`` adds a third pipeline, timed the same way (ABBA order over the three: sync,
async, in-flight, then reversed; lead-ins of ``bound + 1`` steps, so that the rollouts a
producer made ahead before the timed steps are those of its steady state): rollouts that
take each new policy at their next decode chunk, with up to ``--lag`` + 1 steps' rollouts
playing at once, so a sleeping environment's waits overlap each other as well as the
learner's work (its ideal is therefore not ``ideal_ratio``). Each mode reports trained
samples per second (samples the learner trained on / wall time), and ``in_flight_vs_sync``
is the ratio of the medians.

Prints ONE JSON line (progress on stderr).

    python scripts/bench/bench_async.py                        # step delay 0.3 s, 6 steps, 2 rounds
    python scripts/bench/bench_async.py --step-delay 1.0 --ratio 2
    python scripts/bench/bench_async.py --step-delay 0 --steps 4   # no slow env: CPU-bound only
    python scripts/bench/bench_async.py --in-flight --lag 2         # + in-flight updates
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import platform
import statistics
import sys
import tempfile
import time
from importlib import metadata

import common

os.environ.setdefault("JAX_PLATFORMS", "cpu")

import jax  # noqa: E402

ROOT = common.ROOT
sys.path.insert(0, ROOT)

from jaxrl_agentic.config import validate  # noqa: E402
from jaxrl_agentic.pipeline import Pipeline  # noqa: E402
from jaxrl_agentic.train import parse_config  # noqa: E402

BACKEND_COMPILE = "/jax/core/compile/backend_compile_duration"
MEAN_KEYS = ("time/step", "time/rollout", "time/train", "time/wait_for_rollout",
             "off_policy/staleness_mean", "env/num_turns", "env/timeouts",
             "env/truncated_by_length", "tokens/real")


def _parse_args(argv):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--config", default=os.path.join(ROOT, "configs", "frozen_lake.py"),
                        help="recipe file; --config.<key>=<value> overrides pass through")
    parser.add_argument("--step-delay", type=float, default=0.3,
                        help="env_config.step_delay_s: seconds each env step sleeps")
    parser.add_argument("--ratio", type=int, default=1,
                        help="async_generation_ratio of the asynchronous pipeline (>= 1)")
    parser.add_argument("--in-flight", action="store_true",
                        help="also time in-flight weight updates (in_flight_updates=True)")
    parser.add_argument("--lag", type=int, default=2,
                        help="max_policy_lag of the in-flight pipeline (>= 0)")
    parser.add_argument("--steps", type=int, default=6, help="timed steps per mode per round")
    parser.add_argument("--rounds", type=int, default=2, help="timed rounds per mode")
    parser.add_argument("--warmup", type=int, default=2,
                        help="untimed steps per pipeline before the rounds (compilation)")
    parser.add_argument("--groups", type=int, default=2, help="train env groups per step")
    parser.add_argument("--group-size", type=int, default=2, help="episodes per group")
    parser.add_argument("--max-turns", type=int, default=3)
    parser.add_argument("--max-tokens", type=int, default=12,
                        help="max_tokens_per_step: new tokens per reply")
    args, overrides = parser.parse_known_args(argv)
    bad = [a for a in overrides if not a.startswith("--config.")]
    if bad:
        parser.error(f"unrecognised arguments: {' '.join(bad)}")
    if args.ratio < 1:
        parser.error("--ratio must be >= 1 (0 is the synchronous side)")
    if args.lag < 0:
        parser.error("--lag must be >= 0")
    if args.steps < 1 or args.rounds < 1 or args.warmup < 1:
        parser.error("--steps, --rounds and --warmup must be >= 1")
    return args, overrides


def _config(args, overrides, out: str, ratio: int, in_flight: bool = False):
    episodes = args.groups * args.group_size
    c = parse_config([
        "bench", f"--config={args.config}", f"--config.output_dir={out}",
        "--config.pretrain=tiny",
        "--config.format_warmup.steps=0",
        "--config.max_steps=1000",  # the LR schedule's horizon only; nothing stops early
        f"--config.train_env_manager.num_env_groups={args.groups}",
        f"--config.train_env_manager.group_size={args.group_size}",
        "--config.val_env_manager.num_env_groups=2",
        f"--config.mini_batch_size={episodes}",  # trajectory samples: one update per step
        f"--config.custom_envs.frozen_lake.max_turns={args.max_turns}",
        f"--config.custom_envs.frozen_lake.max_tokens_per_step={args.max_tokens}",
        "--config.custom_envs.frozen_lake.env_backend=python",
        f"--config.async_generation_ratio={ratio}",
        *(["--config.in_flight_updates=True", f"--config.max_policy_lag={args.lag}"]
          if in_flight else []),
        *overrides,
    ])
    with c.unlocked():
        c.custom_envs.frozen_lake.env_config.step_delay_s = float(args.step_delay)
    validate(c)
    return c


def _log(message: str) -> None:
    print(f"[bench_async {time.strftime('%H:%M:%S')}] {message}", file=sys.stderr, flush=True)


def _versions() -> dict[str, str]:
    out = {"python": platform.python_version()}
    for name in ("jax", "jaxlib", "flax", "numpy", "transformers"):
        with contextlib.suppress(metadata.PackageNotFoundError):
            out[name] = metadata.version(name)
    return out


def main(argv=None) -> dict:
    args, overrides = _parse_args(sys.argv[1:] if argv is None else argv)
    compiles = [0]

    def on_event(event, duration, **_):
        if event == BACKEND_COMPILE:
            compiles[0] += 1

    jax.monitoring.register_event_duration_secs_listener(on_event)
    load_before = os.getloadavg()[0]
    started = time.perf_counter()
    with tempfile.TemporaryDirectory(prefix="bench_async_") as tmp:
        configs = {"sync": _config(args, overrides, os.path.join(tmp, "sync"), 0),
                   "async": _config(args, overrides, os.path.join(tmp, "async"), args.ratio)}
        if args.in_flight:
            configs["in_flight"] = _config(args, overrides, os.path.join(tmp, "in_flight"), 0,
                                           in_flight=True)
        pipes = {mode: Pipeline(c, log=_log) for mode, c in configs.items()}
        try:
            result = _run(args, pipes, compiles)
        finally:
            for pipe in pipes.values():
                pipe.close()
    c = configs["sync"]
    spec = c.custom_envs.frozen_lake
    result.update({
        "step_delay_s": args.step_delay,
        "async_generation_ratio": args.ratio,
        **({"max_policy_lag": args.lag} if args.in_flight else {}),
        "config": {
            "recipe": os.path.relpath(args.config, ROOT),
            "model": c.pretrain, "env": spec.env_type, "env_backend": spec.env_backend,
            "env_max_workers": spec.env_max_workers, "step_timeout_s": spec.step_timeout_s,
            "num_env_groups": c.train_env_manager.num_env_groups,
            "group_size": c.train_env_manager.group_size,
            "episodes_per_step": pipes["sync"].train_manager.num_episodes,
            "max_turns": spec.max_turns, "max_tokens_per_step": spec.max_tokens_per_step,
            "mini_batch_size": c.mini_batch_size, "ppo_epochs": c.ppo_epochs,
            "sample_mode": c.sample_mode, "adv_estimator": c.adv_estimator,
            "max_input_length": c.max_input_length, "sequence_length": c.sequence_length,
            "overrides": overrides,
        },
        "steps_per_round": args.steps,
        "rounds": args.rounds,
        "warmup_steps": args.warmup,
        "threads": len(os.sched_getaffinity(0)),
        "loadavg_1m": [round(load_before, 2), round(os.getloadavg()[0], 2)],
        "total_s": round(time.perf_counter() - started, 1),
        "timing": f"steps/s = {args.steps} consecutive train_step calls / their wall time; "
                  f"median over {args.rounds} rounds in ABBA order after {args.warmup} "
                  "warm-up steps per pipeline; async and in-flight rounds: bound + 1 "
                  "untimed lead-in steps, then the timed steps, then close() (untimed); "
                  "samples/s = samples trained in the timed steps / their wall time",
        "versions": _versions(),
    })
    print(json.dumps(result))
    return result


def _run(args, pipes, compiles) -> dict:
    modes = tuple(pipes)

    def steps(mode, n):
        out = []
        for _ in range(n):
            metrics, _, _ = pipes[mode].train_step()
            out.append(metrics)
        return out

    for mode in modes:
        start = time.perf_counter()
        steps(mode, args.warmup)
        pipes[mode].close()
        _log(f"{mode}: {args.warmup} warm-up steps in {time.perf_counter() - start:.1f} s")
    compiles_before = compiles[0]
    rates = {mode: [] for mode in modes}
    sample_rates = {mode: [] for mode in modes}
    timed = {mode: [] for mode in modes}
    for r in range(args.rounds):
        for mode in modes if r % 2 == 0 else modes[::-1]:
            if mode != "sync":  # lead-in (untimed): starts the producer, whose queue of
                # up to `bound` rollouts made ahead is then at its steady state
                steps(mode, 1 + (args.lag if mode == "in_flight" else args.ratio))
            start = time.perf_counter()
            got = steps(mode, args.steps)
            seconds = time.perf_counter() - start
            pipes[mode].close()  # async, in-flight: joins the producer (untimed)
            rates[mode].append(args.steps / seconds)
            sample_rates[mode].append(sum(m["batch/sequences_after_merge"] for m in got)
                                      / seconds)
            timed[mode].extend(got)
            _log(f"round {r + 1} {mode}: {args.steps} steps in {seconds:.2f} s "
                 f"({args.steps / seconds:.3f} steps/s)")
    sync_rate = statistics.median(rates["sync"])
    async_rate = statistics.median(rates["async"])

    def mean(mode, key):
        return round(statistics.fmean(m.get(key, 0.0) for m in timed[mode]), 4)

    per_mode = {}
    for mode in modes:
        per_mode[mode] = {key: mean(mode, key) for key in MEAN_KEYS}
        per_mode[mode]["off_policy/staleness_max"] = max(
            m["off_policy/staleness_max"] for m in timed[mode])
        per_mode[mode]["off_policy/dropped"] = sum(m["off_policy/dropped"] for m in timed[mode])
        per_mode[mode]["round_steps_per_s"] = [round(x, 4) for x in rates[mode]]
        per_mode[mode]["samples_per_s"] = round(statistics.median(sample_rates[mode]), 4)
        per_mode[mode]["off_policy/version_lag_max"] = max(
            m["off_policy/version_lag_max"] for m in timed[mode])
        per_mode[mode]["off_policy/version_lag_mean"] = mean(mode, "off_policy/version_lag_mean")
        per_mode[mode]["off_policy/versions_per_episode"] = mean(
            mode, "off_policy/versions_per_episode")
    rollout, train = per_mode["sync"]["time/rollout"], per_mode["sync"]["time/train"]
    staleness_max = per_mode["async"]["off_policy/staleness_max"]
    result = {
        "sync_steps_per_s": round(sync_rate, 4),
        "async_steps_per_s": round(async_rate, 4),
        "ratio": round(async_rate / sync_rate, 3),
        "ideal_ratio": round((rollout + train) / max(rollout, train, 1e-9), 3),
        "staleness_within_bound": staleness_max <= args.ratio,
        **per_mode,
        "new_compilations_after_warmup": compiles[0] - compiles_before,
    }
    if "in_flight" in pipes:
        result["samples_per_s"] = {mode: per_mode[mode]["samples_per_s"] for mode in modes}
        result["in_flight_vs_sync"] = round(per_mode["in_flight"]["samples_per_s"]
                                            / per_mode["sync"]["samples_per_s"], 3)
        result["in_flight_vs_async"] = round(per_mode["in_flight"]["samples_per_s"]
                                             / per_mode["async"]["samples_per_s"], 3)
        result["lag_within_bound"] = (per_mode["in_flight"]["off_policy/version_lag_max"]
                                      <= args.lag)
    return result


if __name__ == "__main__":
    main()
