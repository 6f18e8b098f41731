"""One pipeline step of a recipe at a real model's shape: peak memory, token efficiency,
sampler/learner logprob agreement, time. Prints one JSON line.

    python -m jaxrl_agentic.models.qwen_fixture --out /tmp/qwen24 --layers 24
    python scripts/analysis/real_shape_step.py --model /tmp/qwen24 [--remat layer] \\
        [--episodes 8] [--turns 3] [--new-tokens 32] [-- --config.<field>=<value> ...]

The recipe is configs/qwen2_5_0_5b_frozen_lake.py (fp32 parameters, AdamW, bf16 compute,
a KL reference) with the episode counts and lengths given here; extra `--config.*`
overrides follow `--`. Peak RSS is the process's (Linux ru_maxrss), which includes the
weights read from disk, the warm compile and every transient.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, ROOT)

from jaxrl_agentic.memory_plan import GIB, peak_rss_bytes  # noqa: E402


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", required=True)
    parser.add_argument("--remat", default="layer")
    parser.add_argument("--episodes", type=int, default=8)
    parser.add_argument("--turns", type=int, default=3)
    parser.add_argument("--new-tokens", type=int, default=32)
    parser.add_argument("--row", type=int, default=2048, help="micro_batch_max_tokens")
    parser.add_argument("overrides", nargs="*")
    args = parser.parse_args(argv)

    from jaxrl_agentic.pipeline import Pipeline
    from jaxrl_agentic.train import parse_config

    groups = max(args.episodes // 4, 1)
    c = parse_config([
        "train", f"--config={os.path.join(ROOT, 'configs', 'qwen2_5_0_5b_frozen_lake.py')}",
        f"--config.pretrain={args.model}", "--config.output_dir=/tmp/real_shape_step",
        "--config.max_steps=1", f"--config.remat={args.remat}",
        f"--config.train_env_manager.num_env_groups={groups}",
        f"--config.train_env_manager.group_size={args.episodes // groups}",
        f"--config.mini_batch_size={args.episodes}",
        f"--config.custom_envs.frozen_lake.max_turns={args.turns}",
        f"--config.custom_envs.frozen_lake.max_tokens_per_step={args.new_tokens}",
        "--config.max_input_length=1024", f"--config.sequence_length={min(args.row, 2048)}",
        f"--config.micro_batch_max_tokens={args.row}", *args.overrides])
    start = time.perf_counter()
    pipe = Pipeline(c, log=lambda *a: print(*a, file=sys.stderr))
    built = time.perf_counter()
    metrics, _, samples = pipe.train_step()
    done = time.perf_counter()
    plan = pipe.memory_plan
    pipe.close()
    keys = ("tokens/real", "tokens/loss", "tokens/computed", "tokens/efficiency",
            "rollout/logprob_mismatch", "actor/grad_norm", "time/rollout", "time/train")
    print(json.dumps({
        "model": args.model, "remat": args.remat, "episodes": args.episodes,
        "turns": args.turns, "new_tokens": args.new_tokens, "row": args.row,
        "samples": len(samples), "peak_rss_gib": round(peak_rss_bytes() / GIB, 2),
        "plan_total_gib": round(plan.total / GIB, 2), "init_s": round(built - start, 1),
        "step_s": round(done - built, 1),
        **{k: metrics[k] for k in keys if k in metrics}}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
