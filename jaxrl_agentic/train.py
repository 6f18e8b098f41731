"""Training entry point (glue only):

    python -m jaxrl_agentic.train --config configs/<recipe>.py [--config.<key>=<value> ...]

rollout → samples → advantages → packing → learner updates → metrics → checkpoint / eval,
repeated `max_steps` times. Bad configs and inputs end with one line on stderr and exit
code 2; a run whose updates are non-finite three steps in a row stops with exit code 3; a
run where every episode's environment failed (raised or missed its deadline: `env/errors`,
`env/timeouts`) three steps in a row, so that nothing could be trained, stops with exit
code 4.
"""

from __future__ import annotations

import os
import sys
import time

from jaxrl_agentic.config import (
    ConfigError,
    validate,
    validate_devices,
    validate_distributed,
)

EXIT_BAD_INPUT = 2
EXIT_NONFINITE = 3
EXIT_ENV_FAILED = 4
MAX_CONSECUTIVE_NONFINITE = 3
MAX_CONSECUTIVE_ENV_FAILURES = 3


class NonFiniteError(RuntimeError):
    pass


class EnvFailureError(RuntimeError):
    pass


def every_episode_failed(trajs) -> bool:
    """Every episode of `trajs` was ended by its environment: a reset or step that raised
    or missed its deadline (a Python environment's `env_error` / `env_timeout`). Such a
    step has nothing to train on; a few in a row mean a broken environment (a bug, a
    service down, a deadline too short for it), not bad luck."""
    ended = ("env_error", "env_timeout")
    return bool(trajs) and all(any(t.metrics.get(k, 0.0) for k in ended) for t in trajs)


def parse_config(argv: list[str]):
    """ml_collections config file + `--config.key=value` overrides → ConfigDict."""
    from absl import flags
    from ml_collections import config_flags

    put_recipe_folder_on_path(argv)
    names = flags.FlagValues()
    # config_flags finds `--config.*` overrides in the argv it is given (default sys.argv).
    config_flags.DEFINE_config_file("config", None, "recipe file (configs/*.py)",
                                    flag_values=names, lock_config=True, sys_argv=argv)
    try:
        names(argv)
        config = names.config
        if config is not None:
            config.keys()  # the recipe loads lazily: make a broken file fail here
    except Exception as e:  # absl/ml_collections wrap every problem; keep it to one line
        lines = [line.strip() for line in str(e).strip().splitlines() if line.strip()]
        message = lines[0] if len(lines) == 1 else f"{lines[0]}: {lines[-1]}"
        # An override of a field that does not exist fails with a bare KeyError ("'name'"):
        # name the whole path and what is there instead.
        _check_override_paths(argv)
        raise ConfigError(message) from None
    if config is None:
        raise ConfigError("--config is required, e.g. --config configs/frozen_lake.py")
    return config


def put_recipe_folder_on_path(argv: list[str]) -> None:
    """Appends the folder of the recipe that `argv` names (`--config=PATH[:ARGS]` or
    `--config PATH`) to `sys.path`, once: a recipe is loaded by path, not as a package, so
    this is what lets it import a module beside it (`from my_env import ...`), as a script's
    folder does for the script. At the end of the path, so that the installed packages keep
    their names (`configs/textarena.py` does not hide the `textarena` package)."""
    for i, arg in enumerate(argv[1:], start=1):
        if arg.startswith("--config="):
            path = arg[len("--config="):]
        elif arg == "--config" and i + 1 < len(argv):
            path = argv[i + 1]
        else:
            continue
        folder = os.path.dirname(os.path.abspath(os.path.expanduser(path.split(":", 1)[0])))
        if os.path.isdir(folder) and folder not in sys.path:
            sys.path.append(folder)
        return


def _check_override_paths(argv: list[str]) -> None:
    """Fails (config.fail_unknown_field's one line) on the first `--config.a.b=v` whose
    path the recipe does not have."""
    from jaxrl_agentic.config import fail_unknown_field

    overrides = [a for a in argv[1:] if a.startswith("--config.")]
    if not overrides:
        return
    try:
        config = parse_config([a for a in argv if a not in overrides])
    except ConfigError:
        return
    for arg in overrides:
        node, path = config, []
        for part in arg[len("--config."):].split("=", 1)[0].split("."):
            if not hasattr(node, "keys"):
                break
            if part not in node:
                extra = (" (an env_config holds only the keys its recipe sets: add the key "
                         "to the recipe's env_spec to override it)"
                         if path[-1:] == ["env_config"] else "")
                fail_unknown_field(".".join(path + [part]), node.keys(), extra)
            node, path = node[part], path + [part]


def sample_episode_text(formatter, traj, max_chars: int = 4000) -> str:
    text = formatter.tokenizer.decode(traj.tokens, skip_special_tokens=False)
    return text[-max_chars:]


def write_episode(writer, pipeline, traj, step: int, kind: str, gif_path: str, *,
                  log, unrendered: set[str]) -> bool:
    """The episode as text (`episodes/<kind>`) and, when its environment can draw itself,
    as frames (`episodes/frames` for train, `episodes/eval_frames`) and a GIF.
    → False when the frames were skipped (logged once per env tag)."""
    from jaxrl_agentic.rollout.loop import replay_frames
    from jaxrl_agentic.runtime.metrics_writer import save_gif

    writer.write_text(step, f"episodes/{kind}", sample_episode_text(pipeline.formatter, traj))
    # The runner of the split the episode was played in: a manager's env_config overrides
    # (e.g. denser training maps) change the map a seed draws.
    split = "train" if kind == "train" else "val"
    frames = replay_frames(pipeline.split_runners[split][traj.tag], traj)
    if not frames:
        if traj.tag not in unrendered:
            unrendered.add(traj.tag)
            log(f"env {traj.tag!r}: no episode GIFs (its python env's render_rgb() returns "
                f"None); counted in render/skipped")
        return False
    save_gif(gif_path, frames)
    writer.write_frames(step, "episodes/frames" if kind == "train" else f"episodes/{kind}_frames",
                        frames)
    return True


def run(c, *, log=print) -> dict[str, float]:
    """Trains according to the flat config `c`; returns the last step's metrics."""
    started = time.perf_counter()  # time/elapsed counts the model build and warm-up too
    import jax
    from tqdm import tqdm

    # Before anything else touches the JAX backend (validation and the typed config tree
    # import the environments and the parts): these two fields are read from the flat dict.
    validate_distributed(c)
    validate_devices(c)
    from jaxrl_agentic.runtime.parallel import initialize_distributed, use_cpu_devices

    if c.distributed.enabled:
        initialize_distributed(c.distributed.coordinator_address,
                               c.distributed.num_processes, c.distributed.process_id)
    use_cpu_devices(c.mesh.get("cpu_devices", 1), log=log)
    from jaxrl_agentic.run_config import build_run_config
    devices = jax.devices()
    log(f"devices: {len(devices)} × {devices[0].platform} ({jax.process_count()} process(es))")
    from jaxrl_agentic.data.debug import dump_batch
    from jaxrl_agentic.pipeline import Pipeline
    from jaxrl_agentic.run_loading import run_policy
    from jaxrl_agentic.runtime import timing
    from jaxrl_agentic.runtime.checkpoint import Checkpointer, resolve_checkpoint
    from jaxrl_agentic.runtime.metrics_writer import MetricsWriter, console_line
    from jaxrl_agentic.runtime.transcripts import eval_transcripts, write_transcripts

    validate(c)
    cfg = build_run_config(c)  # from here on only the typed tree is read
    r = cfg.run
    # Every process plays and trains; only process 0 writes logs, text and GIFs.
    # Checkpoints are written by all processes together (orbax coordinates them).
    main_process = jax.process_index() == 0
    if not main_process:
        def log(*_args, **_kwargs):
            return None
    os.makedirs(r.output_dir, exist_ok=True)
    if main_process:
        with open(os.path.join(r.output_dir, "config.json"), "w") as f:
            f.write(cfg.source_json)
    checkpointer = Checkpointer(os.path.join(r.output_dir, "checkpoints"),
                                max_to_keep=r.save_total_limit or None)
    if r.resume_from_checkpoint:  # a bad path fails before any model is built
        directory, step = resolve_checkpoint(r.resume_from_checkpoint, r.output_dir)
    pipeline = Pipeline(cfg, log=log, run_policy=run_policy)
    if r.resume_from_checkpoint:
        source = checkpointer if directory == checkpointer.directory else Checkpointer(directory)
        states, host = source.restore(step, pipeline.train_states())
        pipeline.load_train_states(states)
        pipeline.load_host_state(host)
        log(f"resumed from {directory} at step {pipeline.step}")
    writer = (MetricsWriter(r.output_dir, r.logging_dir, resume_step=pipeline.step)
              if main_process else None)
    bar = tqdm(total=r.max_steps, initial=pipeline.step, desc=r.exp_name, file=sys.stderr,
               disable=not (main_process and sys.stderr.isatty()))
    def evaluate(step: int):
        eval_metrics, eval_trajs = pipeline.evaluate()
        if writer and r.eval_transcripts:
            text = eval_transcripts(pipeline.tokenizer, eval_trajs, r.eval_transcripts)
            if text:
                writer.write_text(step, "episodes/eval_transcripts", text)
                write_transcripts(os.path.join(r.output_dir, "transcripts"), step, text)
        return eval_metrics, eval_trajs

    nonfinite_streak = failed_streak = 0
    unrendered: set[str] = set()  # env tags whose episodes cannot be drawn
    render_skipped = 0
    metrics: dict[str, float] = {}
    try:
        if r.eval_before_training and pipeline.step == 0:
            eval_metrics, _ = evaluate(0)
            eval_metrics["time/elapsed"] = time.perf_counter() - started
            if writer:
                writer.write(0, eval_metrics)
                log(console_line(0, eval_metrics))
        while pipeline.step < r.max_steps:
            metrics, trajs, samples = pipeline.train_step()
            step = pipeline.step
            nonfinite = metrics.get("optim/nonfinite_updates", 0.0) > 0
            nonfinite_streak = nonfinite_streak + 1 if nonfinite else 0
            metrics["optim/nonfinite_streak"] = float(nonfinite_streak)
            if nonfinite:
                log(f"step {step}: non-finite loss or gradient; update skipped "
                    f"({nonfinite_streak} in a row)")
            if nonfinite_streak >= MAX_CONSECUTIVE_NONFINITE:
                _stop(writer, step, metrics, NonFiniteError(
                    f"non-finite loss or gradient in {nonfinite_streak} consecutive steps "
                    f"(last at step {step}); stopping. The last checkpoint holds finite params."
                ))
            failed_streak = failed_streak + 1 if every_episode_failed(trajs) else 0
            metrics["env/failed_streak"] = float(failed_streak)
            if failed_streak >= MAX_CONSECUTIVE_ENV_FAILURES:
                _stop(writer, step, metrics, EnvFailureError(
                    f"every episode's environment failed in {failed_streak} consecutive "
                    f"steps (last at step {step}: env/errors={metrics.get('env/errors', 0):g}, "
                    f"env/timeouts={metrics.get('env/timeouts', 0):g}); stopping. The log "
                    "names each exception ('python env ... raised'); a timeout needs a larger "
                    "step_timeout_s."))
            if r.debug_dump_dir and samples and main_process:
                dump_batch(r.debug_dump_dir, step, pipeline.learner_cfg.packing.pack(samples))
            eval_trajs = []
            if step % r.eval_steps == 0 or step == r.max_steps:
                eval_metrics, eval_trajs = evaluate(step)
                metrics.update(eval_metrics)
            # Wall seconds since this process started the run (a resumed run counts again from
            # 0): "success by minute N" is read from here (scripts/analysis/seed_sweep.py).
            metrics["time/elapsed"] = time.perf_counter() - started
            if writer and (step % r.logging_steps == 0 or step == r.max_steps):
                with timing.span("logging"):
                    # Episodes first, so the metrics line of this step carries render/skipped.
                    # The eval GIF shows an eval episode (greedy, held-out map), not a train one.
                    shown = [("train", trajs, f"step_{step}.gif"),
                             ("eval", eval_trajs, f"eval_step_{step}.gif")]
                    for kind, episodes, name in shown:
                        if episodes and episodes[0].turns and not write_episode(
                                writer, pipeline, episodes[0], step, kind,
                                os.path.join(r.render_save_dir, name), log=log,
                                unrendered=unrendered):
                            render_skipped += 1
                    if unrendered:
                        metrics["render/skipped"] = float(render_skipped)
                    # What the policy keeps saying: a collapse shows here before the reward.
                    writer.write_text(step, "batch/common_replies",
                                      pipeline.common_replies_text(trajs))
                    writer.write(step, metrics)
                    log(console_line(step, metrics))
            if step % r.save_steps == 0 or step == r.max_steps:
                with timing.span("checkpoint"):
                    checkpointer.save(step, pipeline.train_states(), pipeline.host_state())
            bar.update(1)
            bar.set_postfix(reward=f"{metrics.get('env/return', 0):.3f}",
                            tok_s=f"{metrics.get('perf/tokens_per_s', 0):.0f}")
    finally:
        pipeline.close()
        bar.close()
        if writer:
            writer.close()
    return metrics


def _stop(writer, step: int, metrics: dict, error: Exception):
    """Writes the step's metrics (they say why), then ends the run with `error`."""
    if writer:
        writer.write(step, metrics)
    raise error


def main(argv=None) -> int:
    argv = list(sys.argv if argv is None else argv)
    from jaxrl_agentic.models import CheckpointError as ModelError
    from jaxrl_agentic.runtime.checkpoint import CheckpointError

    try:
        c = parse_config(argv)
        run(c)
    except (ConfigError, ModelError, CheckpointError) as e:
        print(f"error: {e}", file=sys.stderr)
        return EXIT_BAD_INPUT
    except NonFiniteError as e:
        print(f"error: {e}", file=sys.stderr)
        return EXIT_NONFINITE
    except EnvFailureError as e:
        print(f"error: {e}", file=sys.stderr)
        return EXIT_ENV_FAILED
    return 0


if __name__ == "__main__":
    sys.exit(main())
