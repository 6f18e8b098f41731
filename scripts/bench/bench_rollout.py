"""Rollout throughput: continuous batching vs turn lockstep, side by side in one run.

The workload is the one continuous batching is for: replies of very different lengths and
an environment whose steps take a variable time.

- **Model**: the tiny default model (`pretrain="tiny"`, built locally) or `--model DIR`.
- **Replies**: up to `--new-tokens` (64) tokens a turn, ended by the model's own EOS. The
  untrained model almost never writes EOS, so its EOS embedding row (tied: also its output
  row) is set to β·μ/|μ|², μ the mean final hidden state over the first prompts: EOS then
  has a logit of ≈ β (`--eos-logit`, 3.5) where the hidden state looks typical and less
  elsewhere. Replies then end after 1 to `--new-tokens` tokens; their lengths are measured
  on the timed lockstep rollouts and printed (`reply_len_median`, `reply_len_p90`,
  `replies_at_max_len`; docs/benchmarks.md quotes a run's). Nothing else about the model
  changes.
- **Environment**: a host-side Python environment (`PythonTextEnv`) that sleeps a time drawn
  uniformly from [0, `--max-latency`] (0.2 s) per step, from a generator seeded by the
  episode and step (the same sleeps in both schedules), answers with a short observation and
  ends after `--turns` (8) steps. Its steps run on the runner's thread pool.
- **Schedules**: `PythonRolloutRunner` with `batching="turn"`, `"continuous"`
  (`--slots`, 0 = one per episode; `--chunk` decode steps between hand-overs) and
  `"continuous"` with its chunks' rows and attention read lengths rounded up to powers of
  two (`pow2`: `SlotDecoder`'s `chunk_grid` before the 1.5× one). All play the same
  `--episodes` (32) episodes with the same seeds: they produce the same trajectories token
  for token (checked: `same_trajectories`), so the work is equal and only the schedule
  differs.

Each schedule plays one untimed warm-up rollout (compiles), then `--repeats` timed ones,
alternating the schedules so all see the same background load; medians are reported.

    episodes/s           = episodes / wall time of one rollout
    generated tokens/s   = generated tokens / wall time
    ratio                = continuous episodes/s ÷ turn episodes/s
    pow2_ratio           = the same with the power-of-two chunk grid
    grid_vs_pow2         = continuous episodes/s ÷ pow2 episodes/s
    <schedule>_rows_per_token = rows the decode steps computed (Σ steps × rows) per
                           generated token: 1.0 would be no padding and no finished row
    new_compilations_after_warmup = sampler programs compiled during the timed continuous
                                    rollouts (turn_new_compilations_after_warmup: turn's)

The timed rollouts use new sampling seeds (other reply lengths, other prompt lengths), so a
compilation count of 0 says the shape buckets hold, not that nothing changed. Continuous
batching compiles its whole bucket grid at its first rollout (`SlotDecoder.precompile`);
turn lockstep compiles a (prompt, cache length) bucket when a rollout first reaches it.

    python scripts/bench/bench_rollout.py
    python scripts/bench/bench_rollout.py --episodes 64 --slots 32 --repeats 5

Prints ONE JSON line.
"""
from __future__ import annotations

import argparse
import json
import statistics
import sys
import time

import common

DEVICE = common.configure()  # before jax is imported

import numpy as np  # noqa: E402

sys.path.insert(0, common.ROOT)

from jaxrl_agentic.envs.python_env import PyStep, PythonTextEnv, text_state_hash  # noqa: E402
from jaxrl_agentic.models import load_pretrained  # noqa: E402
from jaxrl_agentic.models.tiny import default_tiny_model_dir  # noqa: E402
from jaxrl_agentic.rollout.conversation import ChatFormatter  # noqa: E402
from jaxrl_agentic.rollout.groups import EnvManagerConfig, plan_episodes  # noqa: E402
from jaxrl_agentic.rollout.python_runner import PythonRolloutRunner  # noqa: E402
from jaxrl_agentic.rollout.turns import GenerationConfig  # noqa: E402
from jaxrl_agentic.sampling import Sampler  # noqa: E402


class LatencyEnv(PythonTextEnv):
    """Sleeps U[0, max_latency] seconds per step (seeded by episode and step), answers with
    a short observation, ends after `turns` steps; every reply is a valid action."""

    def __init__(self, spec, run_seed: int, *, turns: int, max_latency: float):
        self.spec, self.run_seed = spec, run_seed
        self.max_steps_in_episode, self.max_latency = turns, max_latency
        self.t = 0

    def reset(self, seed: int) -> str:
        self.t = 0
        return f"Episode {seed}. Reply with anything; you have {self.max_steps_in_episode} turns."

    def step(self, reply: str) -> PyStep:
        rng = np.random.default_rng([self.run_seed, self.spec.seed, self.spec.member, self.t])
        time.sleep(float(rng.uniform(0.0, self.max_latency)))
        self.t += 1
        return PyStep(observation=f"Turn {self.t} done ({len(reply)} characters).",
                      reward=0.0, terminated=self.t >= self.max_steps_in_episode,
                      action_is_valid=True, action_is_effective=True, success=False, action=0)

    def state_hash(self) -> bytes:
        return text_state_hash(f"{self.spec.seed}/{self.spec.member}/{self.t}")


def with_early_eos(model, formatter, eos_id: int, beta: float):
    """The model with EOS row β·μ/|μ|² of its (tied) embedding; see the module doc."""
    import jax.numpy as jnp
    from flax import nnx

    prompts = [formatter.first_prompt(f"Episode {i}. Reply with anything.") for i in range(16)]
    width = max(map(len, prompts))
    tokens = np.zeros((len(prompts), width), np.int32)
    for i, p in enumerate(prompts):
        tokens[i, : len(p)] = p
    hidden = model.hidden_states(jnp.asarray(tokens),
                                 jnp.broadcast_to(jnp.arange(width), tokens.shape))
    mu = np.asarray(hidden, np.float64).reshape(-1, hidden.shape[-1]).mean(0)
    graphdef, params = nnx.split(model)
    if not model.cfg.tie_word_embeddings:
        raise SystemExit("--eos-logit needs a model with tied embeddings (e.g. the tiny one)")
    table = params["embed"]["embedding"]
    table.value = table.value.at[eos_id].set(jnp.asarray(beta * mu / (mu @ mu),
                                                         table.value.dtype))
    return nnx.merge(graphdef, params)


def fingerprint(trajs):
    return [(t.tokens, [u.generated for u in t.turns]) for t in trajs]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--device", default="cpu", choices=["cpu", "gpu"])
    parser.add_argument("--model", default="", help="HF model directory (default: tiny)")
    parser.add_argument("--episodes", type=int, default=32)
    parser.add_argument("--turns", type=int, default=8)
    parser.add_argument("--new-tokens", type=int, default=64)
    parser.add_argument("--eos-logit", type=float, default=3.5)
    parser.add_argument("--max-latency", type=float, default=0.2)
    parser.add_argument("--slots", type=int, default=0)
    parser.add_argument("--chunk", type=int, default=8)
    parser.add_argument("--repeats", type=int, default=3)
    args = parser.parse_args()
    common.check_flag(parser, args.device, DEVICE)

    model, tok = load_pretrained(args.model or default_tiny_model_dir())
    formatter = ChatFormatter(tok)
    model = with_early_eos(model, formatter, formatter.eos_token_id, args.eos_logit)
    max_input_length = 1024
    sampler = Sampler(model, tok, max_total_len=max_input_length + args.new_tokens + 1)
    plan = plan_episodes(EnvManagerConfig(num_env_groups=args.episodes // 2, group_size=2,
                                          tags=("bench",)), split="train", cursor=0)["bench"]

    def factory(spec, run_seed):
        return LatencyEnv(spec, run_seed, turns=args.turns, max_latency=args.max_latency)

    def runner(batching: str):
        return PythonRolloutRunner(factory, sampler, formatter, tag="bench",
                                   max_turns=args.turns, max_input_length=max_input_length,
                                   generation=GenerationConfig(max_tokens_per_step=args.new_tokens),
                                   batching=batching, slots=args.slots, decode_chunk=args.chunk)

    runners = {"turn": runner("turn"), "continuous": runner("continuous"),
               "pow2": runner("continuous")}
    runners["pow2"].chunk_grid = "pow2"
    warm = {name: r.run(plan, sample_seed=0) for name, r in runners.items()}
    same = all(fingerprint(warm["turn"]) == fingerprint(w) for w in warm.values())
    times = {name: [] for name in runners}
    tokens = {name: [] for name in runners}
    lengths = []
    new_compiles = {name: 0 for name in runners}
    row_steps = {name: 0 for name in runners}
    for repeat in range(args.repeats):
        for name, r in runners.items():
            before = sampler.compilation_count()
            rows_before = sampler.stats["decode_row_steps"]
            start = time.perf_counter()
            trajs = r.run(plan, sample_seed=1 + repeat)
            times[name].append(time.perf_counter() - start)
            new_compiles[name] += sampler.compilation_count() - before
            tokens[name].append(sum(len(u.generated) for t in trajs for u in t.turns))
            row_steps[name] += sampler.stats["decode_row_steps"] - rows_before
            if name == "turn":
                lengths.extend(len(u.generated) for t in trajs for u in t.turns)
    median = {name: statistics.median(ts) for name, ts in times.items()}
    eps = {name: args.episodes / median[name] for name in runners}
    tps = {name: statistics.median(tokens[name]) / median[name] for name in runners}
    print(json.dumps({
        "bench": "rollout",
        "device": DEVICE,
        "model": args.model or "tiny",
        "episodes": args.episodes,
        "turns": args.turns,
        "max_new_tokens": args.new_tokens,
        "eos_logit": args.eos_logit,
        "reply_len_median": float(np.median(lengths)),
        "reply_len_p90": float(np.percentile(lengths, 90)),
        "replies_at_max_len": float(np.mean(np.asarray(lengths) >= args.new_tokens)),
        "max_env_latency_s": args.max_latency,
        "slots": args.slots or args.episodes,
        "chunk": args.chunk,
        "decode_threads": sampler.decode_threads,
        "turn_s": round(median["turn"], 3),
        "continuous_s": round(median["continuous"], 3),
        "turn_episodes_per_s": round(eps["turn"], 2),
        "continuous_episodes_per_s": round(eps["continuous"], 2),
        "turn_tokens_per_s": round(tps["turn"], 1),
        "continuous_tokens_per_s": round(tps["continuous"], 1),
        "pow2_s": round(median["pow2"], 3),
        "pow2_episodes_per_s": round(eps["pow2"], 2),
        "ratio": round(eps["continuous"] / eps["turn"], 3),
        "pow2_ratio": round(eps["pow2"] / eps["turn"], 3),
        "grid_vs_pow2": round(eps["continuous"] / eps["pow2"], 3),
        # rows the decode steps computed per generated token (1.0: no padding, no idle row)
        **{f"{name}_rows_per_token": round(row_steps[name] / sum(tokens[name]), 3)
           for name in runners},
        "same_trajectories": same,
        "new_compilations_after_warmup": new_compiles["continuous"] + new_compiles["pow2"],
        "turn_new_compilations_after_warmup": new_compiles["turn"],
        "repeats": args.repeats,
    }))


if __name__ == "__main__":
    main()
