"""Where the time of one full pipeline step goes, and whether anything compiles after warm-up.

Builds the default recipe (``configs/frozen_lake.py``, parsed by ``train.parse_config``, so
any ``--config.<key>=<value>`` override works) and runs ``--steps`` steps the way
``train.run`` does: ``Pipeline.train_step()``, then the metrics (``MetricsWriter`` into a
temporary output directory: JSONL + TensorBoard scalars, the first episode as text, its
replayed frames as images and a GIF), then an orbax checkpoint (``Checkpointer.save``).
Logging and checkpointing run every step (``logging_steps = save_steps = 1``), evaluation
only with ``--eval-steps K``. The buckets are timed on one thread: with rollouts on producer
threads (``async_generation_ratio ≥ 1`` or ``in_flight_updates``) they are not recorded
(``buckets_recorded: false``), and the step times and compilations still are. The format
warm-up is off (``format_warmup.steps=0``): the policy is the randomly initialised tiny
model, so nearly every reply is invalid and episodes run to ``max_turns``; that changes what
the rollout produces, not the code it runs. ``--vary-lengths`` swaps each ``frozen_lake``
env for the same lake with a parser that reads any reply as a move (crc32 of the text mod 4,
as in ``tests/test_recompilation.py``): the random policy then walks, falls into holes or
reaches the goal, and episode lengths vary from step to step the way a learning policy's do,
which is what stresses the shape buckets.

Each bucket is a ``jaxrl_agentic.runtime.timing`` span: the library marks where each kind of work
happens, and this script installs a recorder (``timing.recording(ExclusiveTimer())``); nothing
is patched. Times are *exclusive*: a span nested in another one (prefill inside decode) is
charged to the inner bucket only, so the buckets add up to the step time. While a span is
recorded, ``timing.ready`` waits for the device arrays it is given (the prefill's logits),
and every other bucket ends by fetching its results to the host, so asynchronous dispatch
does not push device time into a later bucket. On one CPU device a session of many rows
decodes its row blocks side by side on the sampler's threads: the time the rollout waits
for them is split equally among the blocks' open spans (prefill or decode). Spans nested
in ``eval`` are charged to ``eval``.

    bucket              span(s) (``timing.span`` / ``timing.spanned``)
    rollout/prefill     ``sampling.Session.prefill`` (tail gathering, cache growth, jitted
                        prefill; waits for the logits)
    rollout/decode      ``sampling.Session.generate`` minus its prefill: the jitted
                        ``while_loop`` decode, fetching its outputs, the host bookkeeping
    rollout/env         ``rollout/loop.py``: the runner's jitted reset / step / row select
                        and the copies of their outputs to the host, ``first_message`` /
                        ``feedback_message`` (render_text), ``env.parse_action``,
                        ``env.state_hash``, ``set_episode_metrics``; ``python_runner.py``:
                        the thread-pool reset and step calls
    rollout/tokenize    ``ChatFormatter.first_prompt`` / ``next_prompt`` (chat template +
                        encode) and ``decode_reply``
    rollout/other       the rest of ``Pipeline.rollout``: episode planning and keys, the
                        per-row loop bookkeeping, ``append_prompts``
    samples             ``Pipeline.make_samples`` (advantages, ``build_samples``, whitening,
                        clipping) and ``fold_kl_into_rewards`` (KL-in-reward runs only)
    logprob_mismatch    (no span yet: inside ``learner``) ``Learner.step``'s comparison of
                        the sampler's logprobs with the learner's
    packing             (no span yet: inside ``learner``) ``split_minibatches``,
                        ``pack_minibatches`` and ``pad_to_shards`` in ``UpdateEngine.run``
    learner             ``Learner.step`` as ``Pipeline.train_step`` calls it: logprob check,
                        packing, host-to-device copies, the jitted ``update_step`` per
                        mini-batch, the final device_get, token stats
    critic              ``Critic.step`` as ``Pipeline.train_step`` calls it (gae only)
    pipeline_other      the rest of ``Pipeline.train_step`` (trajectory metrics, LR
                        plan, chunk estimate)
    logging             ``MetricsWriter.write`` / ``write_text`` / ``write_frames``,
                        ``replay_frames`` and ``save_gif``, as ``train.run`` calls them (the
                        script opens this span around its copy of ``train.run``'s block)
    checkpoint          ``Checkpointer.save`` (synchronous; includes the finite check; the
                        script opens this span, as ``train.run`` does)
    eval                ``Pipeline.evaluate`` (only with ``--eval-steps``)

A span name this table does not list is reported too; ``buckets_never_seen`` lists the
buckets no step recorded (the library no longer marks them, or the recipe never runs them).

``step_s`` is the wall time of the whole step (train step + logging + checkpoint [+ eval]);
``other`` is what no bucket claimed (this script's own loop). Means are over the steps after
warm-up (``--warmup-steps``, default 3); ``first_step_s`` is step 1, compilation included.

**Compilations.** ``jax.monitoring`` listeners count, per step and per bucket:

* ``/jax/core/compile/backend_compile_duration`` — fired around
  ``compiler.compile_or_get_cached`` (``pxla._cached_compilation``), i.e. once for every
  program that is not already in the process' in-memory executable cache. It fires for
  persistent-cache hits too, so it counts new programs whether or not the on-disk
  compilation cache (``--compilation-cache``) served them. This is
  ``new_compilations_after_warmup``.
* ``/jax/compilation_cache/cache_hits`` — how many of those came from the on-disk cache.
* ``/jax/core/compile/jaxpr_trace_duration`` and ``jaxpr_to_mlir_module_duration`` — jit
  traces and lowerings (a retrace can happen without a new executable, e.g. a new weak
  type or a fresh function object).

Eager (op-by-op) jax calls are compiled too and are counted. The program names after
warm-up are listed with the bucket that triggered them.

Prints ONE JSON line (progress on stderr).

``--device gpu`` runs the pipeline on one NVIDIA GPU: ``JAX_PLATFORMS=cuda`` is set before jax
is imported (so ``--device`` must be spelled out in full on the command line), instead of the
default ``--device cpu``, which keeps ``JAX_PLATFORMS`` if set and otherwise forces ``cpu``
as before. Nothing else changes: the buckets already block on device outputs. ``backend``
and ``device`` (``jax.devices()[0].device_kind``) say where it ran; ``threads`` is only the
host's core count on gpu.

    python scripts/bench/bench_pipeline.py                       # default recipe, 6 steps
    python scripts/bench/bench_pipeline.py --steps 4 --config.train_env_manager.num_env_groups=2
    python scripts/bench/bench_pipeline.py --device gpu          # one NVIDIA GPU
"""

from __future__ import annotations

import argparse
import collections
import contextlib
import json
import os
import platform
import shutil
import sys
import tempfile
import time
from importlib import metadata

import common

DEVICE = common.configure()  # sets JAX_PLATFORMS before jax is imported

import jax  # noqa: E402

ROOT = common.ROOT
sys.path.insert(0, ROOT)

from jaxrl_agentic import train  # noqa: E402
from jaxrl_agentic.runtime import timing  # noqa: E402
from jaxrl_agentic.runtime.compile_events import CompileEvents  # noqa: E402

BUCKETS = (
    "rollout/prefill", "rollout/decode", "rollout/env", "rollout/tokenize", "rollout/other",
    "samples", "logprob_mismatch", "packing", "learner", "critic", "pipeline_other",
    "logging", "checkpoint", "eval",
)


ANY_REPLY_ENV = "frozen_lake_any_reply"


def _any_reply_overrides(config_path: str, overrides: list[str]) -> list[str]:
    """Registers the any-reply frozen lake; overrides pointing frozen_lake envs at it."""
    import zlib

    from jaxrl_agentic.envs import register, registered_envs
    from jaxrl_agentic.envs.frozen_lake import FrozenLake

    class AnyReplyFrozenLake(FrozenLake):
        def parse_action(self, reply: str) -> int:
            return zlib.crc32(reply.encode()) % self.num_actions

    if ANY_REPLY_ENV not in registered_envs():
        register(ANY_REPLY_ENV, AnyReplyFrozenLake)
    c = train.parse_config(["bench", f"--config={config_path}", *overrides])
    return [f"--config.custom_envs.{tag}.env_type={ANY_REPLY_ENV}"
            for tag, spec in c.custom_envs.items() if spec.env_type == "frozen_lake"]


def _versions() -> dict[str, str]:
    out = {"python": platform.python_version()}
    for name in ("jax", "jaxlib", "flax", "optax", "orbax-checkpoint", "numpy",
                 "transformers"):
        with contextlib.suppress(metadata.PackageNotFoundError):
            out[name] = metadata.version(name)
    return out


def _parse_args(argv):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--config", default=os.path.join(ROOT, "configs", "frozen_lake.py"),
                        help="recipe file; --config.<key>=<value> overrides pass through")
    parser.add_argument("--steps", type=int, default=6, help="pipeline steps in all")
    parser.add_argument("--warmup-steps", type=int, default=3,
                        help="steps excluded from the means and the compilation count")
    parser.add_argument("--eval-steps", type=int, default=0,
                        help="also evaluate every K steps, as train.py does (0 = never)")
    parser.add_argument("--compilation-cache", default="",
                        help="persistent XLA compilation cache directory (default: none)")
    parser.add_argument("--vary-lengths", action="store_true",
                        help="frozen lake reads any reply as a move: episode lengths vary")
    parser.add_argument("--keep-output", action="store_true",
                        help="keep the temporary output directory (metrics, checkpoints)")
    parser.add_argument("--verbose", action="store_true",
                        help="per-step times and new programs on stderr")
    parser.add_argument("--device", choices=("cpu", "gpu"), default="cpu",
                        help="cpu (default) or gpu (JAX_PLATFORMS=cuda); read from the command "
                             "line before jax is imported: spell it out")
    args, overrides = parser.parse_known_args(argv)
    bad = [a for a in overrides if not a.startswith("--config.")]
    if bad:
        parser.error(f"unrecognised arguments: {' '.join(bad)}")
    common.check_flag(parser, args.device, DEVICE,
                       seen="on the command line before jax was imported")
    if args.device == "gpu":
        common.require_jax_gpu(parser.error)
    if args.steps <= args.warmup_steps:
        parser.error("--steps must be larger than --warmup-steps")
    return args, overrides


def main(argv=None) -> dict:
    args, overrides = _parse_args(sys.argv[1:] if argv is None else argv)
    if args.compilation_cache:
        jax.config.update("jax_compilation_cache_dir", args.compilation_cache)
        jax.config.update("jax_persistent_cache_min_compile_time_secs", 0.0)
        jax.config.update("jax_persistent_cache_min_entry_size_bytes", 0)
    from jaxrl_agentic.config import validate
    from jaxrl_agentic.run_config import build_run_config
    from jaxrl_agentic.runtime.checkpoint import Checkpointer
    from jaxrl_agentic.runtime.metrics_writer import MetricsWriter, save_gif
    from jaxrl_agentic.runtime.parallel import use_cpu_devices

    load_before = os.getloadavg()[0]
    # As train.run does, before anything starts the backend (importing the pipeline does).
    recipe = train.parse_config(["bench", f"--config={args.config}", *overrides])
    cpu_devices = use_cpu_devices(recipe.mesh.get("cpu_devices", 1))
    from jaxrl_agentic import pipeline as pipeline_module
    from jaxrl_agentic.rollout import loop as loop_module

    if args.vary_lengths:
        overrides = overrides + _any_reply_overrides(args.config, overrides)
    tmp = tempfile.mkdtemp(prefix="bench_pipeline_")
    c = train.parse_config([
        "bench", f"--config={args.config}", f"--config.output_dir={tmp}",
        "--config.format_warmup.steps=0", f"--config.max_steps={args.steps}",
        "--config.logging_steps=1", "--config.save_steps=1", *overrides,
    ])
    validate(c)
    # Rollouts on producer threads: the exclusive timer would charge their spans as work
    # the training thread waits for, so only step times and compilations are recorded.
    threaded = bool(c.get("async_generation_ratio", 0) or c.get("in_flight_updates", False))
    cfg = build_run_config(c)
    paths = {"output_dir": cfg.run.output_dir, "logging_dir": cfg.run.logging_dir,
             "render_save_dir": cfg.run.render_save_dir}
    timer = timing.ExclusiveTimer(absorbing={"eval"})  # eval's rollout is evaluation time
    recording = contextlib.nullcontext() if threaded else timing.recording(timer)
    with CompileEvents(label=lambda: timer.current) as counter, recording:
        t0 = time.perf_counter()
        pipeline = pipeline_module.Pipeline(cfg)
        build_s = time.perf_counter() - t0
        writer = MetricsWriter(paths["output_dir"], paths["logging_dir"])
        checkpointer = Checkpointer(os.path.join(paths["output_dir"], "checkpoints"))
        per_step, seen = [], set()
        for _ in range(args.steps):
            timer.take()
            mark = counter.mark()
            start = time.perf_counter()
            metrics, trajs, _ = pipeline.train_step()
            step = pipeline.step
            if args.eval_steps and (step % args.eval_steps == 0 or step == c.max_steps):
                metrics.update(pipeline.evaluate()[0])
            if step % c.logging_steps == 0 or step == c.max_steps:  # as train.run does
                with timing.span("logging"):
                    writer.write(step, metrics)
                    if trajs and trajs[0].turns:
                        writer.write_text(step, "episodes/train", train.sample_episode_text(
                            pipeline.formatter, trajs[0]))
                        frames = loop_module.replay_frames(
                            pipeline.split_runners["train"][trajs[0].tag], trajs[0])
                        save_gif(os.path.join(paths["render_save_dir"], f"step_{step}.gif"),
                                 frames)
                        writer.write_frames(step, "episodes/frames", frames)
            if step % c.save_steps == 0 or step == c.max_steps:
                with timing.span("checkpoint"):
                    checkpointer.save(step, pipeline.train_states(), pipeline.host_state())
            step_s = time.perf_counter() - start
            times = timer.take()
            seen.update(times)
            record = {
                "step": step, "step_s": step_s, "times": times,
                "compiles": counter.since(mark, "compile"),
                "traces": counter.since(mark, "trace"),
                "lowerings": counter.since(mark, "lower"),
                "cache_hits": counter.since(mark, "cache_hit"),
                "tokens_real": metrics.get("tokens/real", 0.0),
                "generated_tokens": sum(len(u.generated) for t in trajs for u in t.turns),
                "turns": sum(len(t.turns) for t in trajs),
                "episode_turns": [min((len(t.turns) for t in trajs), default=0),
                                  max((len(t.turns) for t in trajs), default=0)],
                "num_samples": metrics.get("batch/num_samples", 0.0),
                "micro_batches": metrics.get("batch/num_micro_batches", 0.0),
            }
            per_step.append(record)
            if args.verbose:
                print(json.dumps({k: v for k, v in record.items() if k != "times"}
                                 | {"times": {k: round(v, 3) for k, v in times.items()}}),
                      file=sys.stderr)
            else:
                print(f"step {step}: {step_s:.2f} s, {len(record['compiles'])} programs "
                      "compiled", file=sys.stderr)
        writer.close()
        if hasattr(pipeline, "close"):
            pipeline.close()
    if not args.keep_output:
        shutil.rmtree(tmp, ignore_errors=True)
    result = summarize(args, c, per_step, build_s, seen, load_before, pipeline)
    result["buckets_recorded"] = not threaded
    result["cpu_devices"] = {"config": c.mesh.get("cpu_devices", 1), "asked": cpu_devices,
                             "devices": len(jax.devices())}
    print(json.dumps(result))
    return result


def summarize(args, c, per_step, build_s, seen, load_before, pipeline) -> dict:
    after = per_step[args.warmup_steps:]
    n = len(after)
    step_s = sum(r["step_s"] for r in after) / n
    names = list(BUCKETS) + sorted(seen - set(BUCKETS))  # a span this script does not know
    means = {k: sum(r["times"].get(k, 0.0) for r in after) / n for k in names}
    means = {k: v for k, v in means.items() if v > 0 or not k.startswith(("critic", "eval"))}
    means["other"] = step_s - sum(means.values())
    rollout_s = sum(v for k, v in means.items() if k.startswith("rollout/"))

    def total(key):
        return sum(r[key] for r in after) / n

    new_compiles = [p for r in after for p in r["compiles"]]
    by_bucket = collections.Counter(bucket for _, bucket in new_compiles)
    model = pipeline.sampler.cfg
    return {
        "config": os.path.relpath(args.config, ROOT) if args.config.startswith(ROOT)
        else args.config,
        "backend": jax.default_backend(),
        "device": jax.devices()[0].device_kind,
        "steps": args.steps,
        "warmup_steps": args.warmup_steps,
        "step_s": round(step_s, 4),
        "first_step_s": round(per_step[0]["step_s"], 2),
        "pipeline_build_s": round(build_s, 2),
        "bucket_s": {k: round(v, 4) for k, v in means.items()},
        "bucket_fraction": {k: round(v / step_s, 4) for k, v in means.items()},
        "rollout_s": round(rollout_s, 4),
        "tokens_per_s": round(total("tokens_real") / step_s, 1),
        "train_tokens_per_s": round(
            total("tokens_real") / max(means["learner"] + means["packing"], 1e-9), 1),
        "generated_tokens_per_s": round(total("generated_tokens") / max(rollout_s, 1e-9), 1),
        "per_step": {
            "step_s": [round(r["step_s"], 2) for r in per_step],
            "turns": [r["turns"] for r in per_step],
            "episode_turns_min_max": [r["episode_turns"] for r in per_step],
            "generated_tokens": [r["generated_tokens"] for r in per_step],
            "tokens_real": [r["tokens_real"] for r in per_step],
            "micro_batches": [r["micro_batches"] for r in per_step],
            "compilations": [len(r["compiles"]) for r in per_step],
            "persistent_cache_hits": [len(r["cache_hits"]) for r in per_step],
            "traces": [len(r["traces"]) for r in per_step],
        },
        "new_compilations_after_warmup": len(new_compiles),
        "new_traces_after_warmup": sum(len(r["traces"]) for r in after),
        "new_lowerings_after_warmup": sum(len(r["lowerings"]) for r in after),
        "persistent_cache_hits_after_warmup": sum(len(r["cache_hits"]) for r in after),
        "compilations_after_warmup_by_bucket": dict(by_bucket),
        "programs_after_warmup": sorted({f"{name} @ {bucket}" for name, bucket in new_compiles}),
        "buckets_never_seen": [k for k in BUCKETS if k not in seen],
        "shape": {
            "episodes_per_step": pipeline.train_manager.num_episodes,
            "max_turns": {t: s.max_turns for t, s in c.custom_envs.items()},
            "max_tokens_per_step": {t: s.max_tokens_per_step for t, s in c.custom_envs.items()},
            "max_input_length": c.max_input_length,
            "sequence_length": c.sequence_length,
            "micro_batch_max_tokens": c.micro_batch_max_tokens,
            "mini_batch_size": c.mini_batch_size,
            "rows_bucket": c.rows_bucket,
            "fixed_rows": c.get("fixed_rows"),
            "sample_mode": c.sample_mode,
            "adv_estimator": c.adv_estimator,
            "format_warmup_steps": c.format_warmup.steps,
            "env_types": {t: s.env_type for t, s in c.custom_envs.items()},
        },
        "model": {"hidden": model.hidden_size, "layers": model.num_hidden_layers,
                  "vocab": model.vocab_size, "dtype": c.dtype},
        "threads": len(os.sched_getaffinity(0)),
        "loadavg_1m": [round(load_before, 2), round(os.getloadavg()[0], 2)],
        "timing": f"exclusive wall time per bucket, mean over steps {args.warmup_steps + 1}.."
                  f"{args.steps}; logging and checkpoint every step",
        "versions": _versions(),
    }


if __name__ == "__main__":
    main()
