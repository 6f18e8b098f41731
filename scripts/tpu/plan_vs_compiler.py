"""The memory plan a run prints against XLA's TPU compiler, model by model, topology by
topology: one JSON line per configuration.

    /opt/tpuvenv/bin/python scripts/tpu/plan_vs_compiler.py [--only qwen0.5b,smollm2] \
        [--topologies v5e:2x2,v5p:2x2x1] [--lora both|full|lora]

Each configuration is one `python -m jaxrl_agentic.compile_tpu` run (a process of its own:
libtpu, and the compiler's memory, start clean) of the model's recipe with the parameters
sharded over every chip (`mesh.fsdp` = chips, `mesh.data` = 1), the update step only, at
the longest row (`--row-lens longest`: the most memory). From its JSON lines:

    compiler_peak   the update step's per-chip peak (resident state + its other arguments +
                    outputs − aliased + temporaries + code, `compile_tpu`'s `peak_bytes`)
    plan_total      the memory plan's total (`pipeline/run_plan.run_memory_plan`, what a
                    run prints at start), and its learner part `plan_learner` (without the
                    sampler's KV cache and logits, which the update step does not hold)
    state           the compiler's resident bytes (the update's donated arguments) against
                    the plan's parameters + reference + teacher + optimizer
    ratio           compiler_peak / plan_learner (> 1.15: the plan misses something)

A configuration the compiler refuses (RESOURCE_EXHAUSTED) or whose state cannot fit is a
line with `fits: false` and the command's one error line. Needs libtpu (docs/tpu.md).
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
# name -> (recipe, pretrain, LoRA rank of the "lora" variant)
MODELS = {
    "smollm2": ("configs/smollm2_frozen_lake.py", "smollm2-135m-instruct", 16),
    "qwen0.5b": ("configs/qwen2_5_0_5b_frozen_lake.py", "/models/Qwen2.5-0.5B-Instruct", 16),
    "qwen1.5b": ("configs/qwen2_5_0_5b_frozen_lake.py", "/models/Qwen2.5-1.5B-Instruct", 16),
    "qwen7b": ("configs/qwen2_5_0_5b_frozen_lake.py", "/models/Qwen2.5-7B-Instruct", 16),
}
CHIPS = {"v5e:1x1": 1, "v5e:2x2": 4, "v5e:2x4": 8, "v5e:4x4": 16, "v5p:2x2x1": 4,
         "v6e:2x4": 8}
# The plan's items the update step holds (the sampler's are another program's).
LEARNER_ITEMS = ("parameters", "reference", "teacher", "gradients", "accumulator",
                 "optimizer", "update", "activations", "lm head")
STATE_ITEMS = ("parameters", "reference", "teacher", "optimizer")


def compile_one(model: str, lora: bool, topology: str, timeout: int) -> dict:
    recipe, pretrain, rank = MODELS[model]
    chips = CHIPS[topology]
    cmd = [sys.executable, "-m", "jaxrl_agentic.compile_tpu", "--config", recipe,
           "--topology", topology, "--row-lens", "longest", "--programs", "update_step",
           f"--config.pretrain={pretrain}", f"--config.lora_rank={rank if lora else 0}",
           f"--config.mesh.fsdp={chips}", "--config.mesh.data=1"]
    start = time.perf_counter()
    try:
        out = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=timeout)
    except subprocess.TimeoutExpired:
        return {"error": f"timed out after {timeout} s"}
    lines = [json.loads(line) for line in out.stdout.splitlines() if line.startswith("{")]
    errors = [line for line in out.stderr.splitlines() if line.startswith("error:")]
    result = {"rc": out.returncode, "wall_s": round(time.perf_counter() - start, 1)}
    if errors:
        result["error"] = errors[0]
    update = next((line for line in lines if line["program"] == "update_step"), None)
    total = next((line for line in lines if line["program"] == "total"), None)
    if total is None:
        return result
    plan = total["plan_bytes"]
    plan_learner = sum(plan.get(k, 0) for k in LEARNER_ITEMS)
    result.update({
        "mesh": total["mesh"], "hbm_gib": round(total["hbm_bytes_per_chip"] / 2**30, 2),
        "fits": total["fits"], "plan_total_gib": round(total["plan_total_bytes"] / 2**30, 2),
        "plan_learner_gib": round(plan_learner / 2**30, 2),
        "plan_state_gib": round(sum(plan.get(k, 0) for k in STATE_ITEMS) / 2**30, 2),
        "state_gib": round(total["state_bytes"] / 2**30, 2),
        "plan_gib": {k: round(v / 2**30, 3) for k, v in plan.items()}})
    if update is not None and "peak_bytes" in update:
        result.update({"compiler_peak_gib": round(update["peak_bytes"] / 2**30, 2),
                       "temp_gib": round(update["temp_bytes"] / 2**30, 2),
                       "compile_s": update["compile_s"],
                       "ratio": round(update["peak_bytes"] / max(plan_learner, 1), 3)})
    return result


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--only", default=",".join(MODELS), help="models, comma-separated")
    parser.add_argument("--topologies", default=",".join(CHIPS))
    parser.add_argument("--lora", choices=("both", "full", "lora"), default="both")
    parser.add_argument("--timeout", type=int, default=1800, help="seconds per compile")
    args = parser.parse_args()
    variants = {"both": (False, True), "full": (False,), "lora": (True,)}[args.lora]
    for model in args.only.split(","):
        for topology in args.topologies.split(","):
            for lora in variants:
                result = compile_one(model, lora, topology, args.timeout)
                print(json.dumps({"model": model, "lora": lora, "topology": topology,
                                  **result}), flush=True)


if __name__ == "__main__":
    main()
