"""One pipeline step of a recipe at a real model's shape: peak memory, token efficiency,
sampler/learner logprob agreement, time. Prints one JSON line.

    python -m jaxrl_agentic.models.qwen_fixture --out /tmp/qwen24 --layers 24
    python scripts/analysis/real_shape_step.py --model /tmp/qwen24 [--remat layer] \\
        [--episodes 8] [--turns 3] [--new-tokens 32] [-- --config.<field>=<value> ...]

The recipe is configs/qwen2_5_0_5b_frozen_lake.py (fp32 parameters, AdamW, bf16 compute,
a KL reference) with the episode counts and lengths given here; extra `--config.*`
overrides follow `--`. `--recipe configs/<other>.py` runs another recipe at its own shape
(its model unless `--model`; the shape flags then apply only where given):

    python scripts/analysis/real_shape_step.py --recipe configs/smollm2_frozen_lake.py --steps 3
 `--steps N` runs N steps and reports the last: with N ≥ 2 its time
and `breakdown_s` (exclusive seconds per `jaxrl_agentic.runtime.timing` span: rollout/prefill,
rollout/decode, rollout/env, learner, ...) hold no compilation; `peak_growth_gib` covers
every step. Peak RSS is the process's (Linux ru_maxrss), which includes the weights read
from disk, the warm compile and every transient.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, ROOT)

from jaxrl_agentic.runtime.memory_plan import GIB, peak_rss_bytes  # noqa: E402


class PeakGrowth:
    """A timing recorder that also charges each rise of the process's peak RSS to the span
    of `timer` that was running when it happened (`peak_growth_gib`: where the peak was
    made, over every step run; `timer` is swapped for a fresh one per step)."""

    def __init__(self):
        self.timer, self.last, self.growth = None, peak_rss_bytes(), {}

    def note(self) -> None:
        now = peak_rss_bytes()
        if now > self.last:
            name = self.timer.current
            self.growth[name] = self.growth.get(name, 0.0) + now - self.last
            self.last = now

    def enter(self, name: str) -> None:
        self.note()
        self.timer.enter(name)

    def exit(self, name: str) -> None:
        self.note()
        self.timer.exit(name)


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    default_recipe = os.path.join(ROOT, "configs", "qwen2_5_0_5b_frozen_lake.py")
    parser.add_argument("--recipe", default=default_recipe)
    parser.add_argument("--model", default=None, help="default: the recipe's pretrain")
    parser.add_argument("--remat", default=None)
    parser.add_argument("--episodes", type=int, default=None)
    parser.add_argument("--turns", type=int, default=None)
    parser.add_argument("--new-tokens", type=int, default=None)
    parser.add_argument("--row", type=int, default=None, help="micro_batch_max_tokens")
    parser.add_argument("--steps", type=int, default=1, help="steps run; the last is reported")
    parser.add_argument("overrides", nargs="*")
    args = parser.parse_args(argv)
    if os.path.abspath(args.recipe) == default_recipe:  # the 0.5B shape's defaults
        if args.model is None:
            parser.error("--model is required with the default recipe")
        for name, value in (("remat", "layer"), ("episodes", 8), ("turns", 3),
                            ("new_tokens", 32), ("row", 2048)):
            if getattr(args, name) is None:
                setattr(args, name, value)

    from jaxrl_agentic.pipeline import Pipeline
    from jaxrl_agentic.runtime import timing
    from jaxrl_agentic.train import parse_config

    recipe = parse_config(["train", f"--config={args.recipe}"])
    tag = next(iter(recipe.custom_envs))
    shape = [f"--config.pretrain={args.model}"] if args.model else []
    if args.remat:
        shape.append(f"--config.remat={args.remat}")
    if args.episodes:
        groups = max(args.episodes // 4, 1)
        shape += [f"--config.train_env_manager.num_env_groups={groups}",
                  f"--config.train_env_manager.group_size={args.episodes // groups}",
                  f"--config.mini_batch_size={args.episodes}"]
    if args.turns:
        shape.append(f"--config.custom_envs.{tag}.max_turns={args.turns}")
    if args.new_tokens:
        shape.append(f"--config.custom_envs.{tag}.max_tokens_per_step={args.new_tokens}")
    if args.row:
        shape += ["--config.max_input_length=1024",
                  f"--config.sequence_length={min(args.row, 2048)}",
                  f"--config.micro_batch_max_tokens={args.row}"]
    c = parse_config([
        "train", f"--config={args.recipe}", "--config.output_dir=/tmp/real_shape_step",
        f"--config.max_steps={args.steps}", *shape,
        *args.overrides])
    start = time.perf_counter()
    pipe = Pipeline(c, log=lambda *a: print(*a, file=sys.stderr))
    init_s, init_peak = time.perf_counter() - start, peak_rss_bytes()
    recorder = PeakGrowth()
    for _ in range(args.steps):
        built = time.perf_counter()
        timer = recorder.timer = timing.ExclusiveTimer()
        with timing.recording(recorder):
            metrics, _, samples = pipe.train_step()
        recorder.note()
    done = time.perf_counter()
    plan = pipe.memory_plan
    pipe.close()
    keys = ("tokens/real", "tokens/loss", "tokens/computed", "tokens/efficiency",
            "tokens/shared_saved", "rollout/logprob_mismatch", "actor/grad_norm",
            "time/rollout", "time/train", "perf/tokens_per_s")
    print(json.dumps({
        "recipe": os.path.relpath(args.recipe, ROOT), "model": c.pretrain, "remat": c.remat,
        "episodes": len(samples) if c.sample_mode == "trajectory" else None,
        "steps": args.steps, "row": c.micro_batch_max_tokens,
        "samples": len(samples), "peak_rss_gib": round(peak_rss_bytes() / GIB, 2),
        "peak_rss_after_init_gib": round(init_peak / GIB, 2),
        "peak_growth_gib": {k: round(v / GIB, 2) for k, v in recorder.growth.items()},
        "plan_total_gib": round(plan.total / GIB, 2), "init_s": round(init_s, 1),
        "step_s": round(done - built, 1),
        **{k: metrics[k] for k in keys if k in metrics},
        "breakdown_s": {k: round(v, 1) for k, v in sorted(timer.take().items())}}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
