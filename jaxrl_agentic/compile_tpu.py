"""Compile a run's programs for a TPU topology without a TPU, and check that they fit (glue):

    python -m jaxrl_agentic.compile_tpu --config configs/<recipe>.py --topology v5e:2x2 \\
        [--row-lens all|longest] [--programs update_step,logprobs,...] [--config.<key>=<value> ...]

Builds the run's programs from shapes alone (``pipeline/aot_programs.py``: no weight is
read), compiles each with XLA's TPU compiler for the chips of ``--topology`` and prints one
JSON line per program (its shape, compile seconds, the compiler's per-chip argument /
output / aliased / temp / generated-code bytes, the peak a chip holds while it runs, and
the collectives in its HLO), then one ``"program": "total"`` line: the largest peak against
one chip's HBM, beside the run's memory plan (``runtime/memory_plan.py``).
``--topology cpu:N`` compiles for N host devices instead (no libtpu needed).
``--row-lens longest``: the update step at the longest row only (the most memory; a
recipe with many row-length buckets compiles one program per bucket). ``--programs``:
only those (``update_step``, ``logprobs``, ``ref_logprobs``, ``teacher_logprobs``,
``sampler_prefill``, ``sampler_decode``); the sampler's are built only when named or by default.

Exit codes: 0 every program fits; 1 one does not (its peak is over one chip's HBM, the
compiler refused it with RESOURCE_EXHAUSTED, or the train state alone is too big, found
before compiling anything): one ``error:`` line naming what to change; 2 bad input, or no
libtpu here (one line saying how to install it).
"""

from __future__ import annotations

import argparse
import copy
import json
import os
import sys
import time

EXIT_DOES_NOT_FIT = 1
EXIT_BAD_INPUT = 2


def _split_argv(argv: list[str]) -> tuple[argparse.Namespace, list[str]]:
    """(this command's flags, the rest: --config and its overrides, for ``parse_config``)."""
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], allow_abbrev=False)
    parser.add_argument("--config", required=True, help="recipe file (configs/*.py)")
    parser.add_argument("--topology", default="v5e:2x2",
                        help="a TPU topology (v5e:2x2, v5p:2x2x1, v6e:2x4, ...) or cpu:N")
    parser.add_argument("--row-lens", choices=("all", "longest"), default="all",
                        help="the update step at every row length of the packing, or the "
                             "longest only")
    parser.add_argument("--programs", default="",
                        help="comma-separated program names (default: all)")
    args, rest = parser.parse_known_args(argv[1:])  # rest: the --config.<key>=<value>s
    return args, [*argv[:1], "--config", args.config, *rest]


def _host_devices(topology_name: str) -> None:
    """``cpu:N``: N host devices, set before JAX starts (unless XLA_FLAGS already does)."""
    if topology_name.startswith("cpu:"):
        flags = os.environ.get("XLA_FLAGS", "")
        if "xla_force_host_platform_device_count" not in flags:
            count = topology_name.split(":", 1)[1]
            os.environ["XLA_FLAGS"] = f"{flags} --xla_force_host_platform_device_count={count}"


def _checked_config(c):
    """The flat config validated; a published checkpoint that is not on this machine
    (``models/known_shapes.py``) passes the ``pretrain`` check, as its shapes are known."""
    from jaxrl_agentic.config import validate
    from jaxrl_agentic.models.known_shapes import known_model_config
    from jaxrl_agentic.models.sources import source_problem

    checked = c
    if c.pretrain not in ("tiny", "tiny-tools") and source_problem(c.pretrain) \
            and known_model_config(c.pretrain) is not None:
        checked = copy.deepcopy(c)
        checked.pretrain = "tiny"
    validate(checked)


def _run_config(c):
    """The typed tree; for a known shape not on disk, LoRA's ``untied_head`` as loading it
    would decide (``run_config.loading_unties_head`` cannot read it)."""
    import dataclasses

    from jaxrl_agentic.models.known_shapes import known_model_config
    from jaxrl_agentic.run_config import build_run_config

    cfg = build_run_config(c)
    known = known_model_config(c.pretrain)
    lora_cfg = cfg.model.lora
    if (known is not None and c.untie_word_embeddings and known.tie_word_embeddings
            and lora_cfg.enabled and not lora_cfg.untied_head):
        model = dataclasses.replace(cfg.model, lora=dataclasses.replace(lora_cfg,
                                                                        untied_head=True))
        cfg = dataclasses.replace(cfg, model=model)
    return cfg


def _advice(name: str, figures: dict, state_bytes: float, hbm: float,
            replica_bytes: float = 0.0) -> str:
    """What to change when program ``name`` does not fit."""
    if state_bytes > hbm and state_bytes - replica_bytes <= 0.8 * hbm:
        return (f"the sampler's replica of the whole policy ({replica_bytes / 2**30:.2f} GiB "
                "a chip: over several hosts every host samples from one) does not shrink "
                "with mesh.fsdp: param_dtype='bfloat16' halves it, or use chips that hold it")
    if state_bytes > hbm:
        return ("the train state alone does not fit: shard it over more chips "
                "(--config.mesh.fsdp=<chips>, mesh.data=1), use param_dtype='bfloat16' or "
                "init_kl_coef=0 (no reference copy)")
    if name.startswith("sampler"):
        return ("the sampler's KV cache and logits: fewer episodes per step "
                "(train_env_manager), a shorter max_input_length, or mesh.fsdp/tensor > 1")
    return ("activations: remat='layer', a smaller micro_batch_max_tokens, or more chips "
            "on mesh.fsdp")


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv if argv is None else argv)
    args, config_argv = _split_argv(argv)
    _host_devices(args.topology)
    import jax

    from jaxrl_agentic.config import ConfigError
    from jaxrl_agentic.runtime import aot
    from jaxrl_agentic.train import parse_config

    try:
        topology = aot.topology(args.topology)
    except aot.CompilerUnavailable as e:
        print(f"error: {e}", file=sys.stderr)
        return EXIT_BAD_INPUT
    except ValueError as e:
        print(f"error: {e}", file=sys.stderr)
        return EXIT_BAD_INPUT
    if topology.platform != "cpu":
        # An executable compiled without a TPU client cannot be read back from the cache.
        jax.config.update("jax_enable_compilation_cache", False)
    from jaxrl_agentic.pipeline.aot_programs import PROGRAM_NAMES, run_programs
    from jaxrl_agentic.pipeline.distillation import teacher_model_config
    from jaxrl_agentic.pipeline.run_plan import run_memory_plan

    try:
        with aot.traced_for(topology.platform):  # "auto" settings resolve for the target
            c = parse_config(config_argv)
            _checked_config(c)
            cfg = _run_config(c)
            wanted = tuple(p for p in args.programs.split(",") if p)
            unknown = set(wanted) - set(PROGRAM_NAMES)
            if unknown:
                raise ValueError(f"--programs: unknown program {sorted(unknown)[0]!r}; "
                                 f"choose from {', '.join(PROGRAM_NAMES)}")
            run = run_programs(cfg, topology.devices, row_lens=args.row_lens,
                               sampler=not wanted or any(p.startswith("sampler")
                                                         for p in wanted))
    except (ConfigError, ValueError) as e:
        print(f"error: {str(e).splitlines()[0]}", file=sys.stderr)
        return EXIT_BAD_INPUT
    for note in run.notes:
        print(note, file=sys.stderr)
    hbm = topology.hbm_bytes
    if hbm and run.state_bytes > hbm:  # certain failure: nothing to compile
        print(f"error: the train state needs {run.state_bytes / aot.GIB:.2f} GiB per chip on "
              f"mesh {dict(run.mesh.shape)}, over the {hbm / aot.GIB:.1f} GiB of one "
              f"{topology.devices[0].device_kind} chip: "
              + _advice("state", {}, run.state_bytes, hbm, run.replica_bytes), file=sys.stderr)
        return EXIT_DOES_NOT_FIT
    worst, refused = (0.0, None, None), []
    for program in run.programs:
        if wanted and program.name not in wanted:
            continue
        start = time.perf_counter()
        try:
            compiled = aot.compile_abstract(program.fn, *program.args,
                                            platform=topology.platform)
        except jax.errors.JaxRuntimeError as e:  # XLA:TPU refuses what cannot fit its HBM
            if "RESOURCE_EXHAUSTED" not in str(e):
                raise
            message = str(e).splitlines()[0]
            print(json.dumps({"program": program.name, **program.shape,
                              "compile_s": round(time.perf_counter() - start, 1),
                              "error": message}), flush=True)
            refused.append((program, message))
            continue
        seconds = time.perf_counter() - start
        figures = aot.program_figures(compiled)
        peak = aot.peak_bytes(figures, run.state_bytes, program.resident)
        if peak > worst[0]:
            worst = (peak, program, figures)
        print(json.dumps({"program": program.name, **program.shape,
                          "compile_s": round(seconds, 1), **figures,
                          "peak_bytes": int(peak)}), flush=True)
    plan = run_memory_plan(cfg, run.model, run.mesh, hbm, platform=topology.platform,
                           teacher=teacher_model_config(cfg.distillation))
    peak, program, figures = worst
    fits = (not hbm or peak <= hbm) and not refused
    print(json.dumps({
        "program": "total", "topology": topology.name, "chips": topology.chips,
        "device_kind": topology.devices[0].device_kind, "mesh": dict(run.mesh.shape),
        "hbm_bytes_per_chip": int(hbm), "state_bytes": int(run.state_bytes),
        "param_bytes": int(run.param_bytes), "param_global_bytes": int(run.param_global_bytes),
        "peak_program": None if program is None else program.name,
        "peak_bytes": int(peak), "fits": fits,
        "refused": [p.name for p, _ in refused],
        "plan_bytes": {name: int(b) for name, b in plan.items},
        "plan_total_bytes": int(plan.total)}), flush=True)
    if refused:
        program, message = refused[0]
        print(f"error: {program.name} {program.shape} does not fit one "
              f"{topology.devices[0].device_kind} chip (the compiler: {message}): "
              + _advice(program.name, {}, run.state_bytes, hbm, run.replica_bytes), file=sys.stderr)
        return EXIT_DOES_NOT_FIT
    if not fits:
        gib = aot.GIB
        print(f"error: {program.name} {program.shape} needs {peak / gib:.2f} GiB per chip, "
              f"over the {hbm / gib:.1f} GiB of one {topology.devices[0].device_kind} chip: "
              + _advice(program.name, figures, run.state_bytes, hbm,
                       run.replica_bytes), file=sys.stderr)
        return EXIT_DOES_NOT_FIT
    return 0


if __name__ == "__main__":
    sys.exit(main())
