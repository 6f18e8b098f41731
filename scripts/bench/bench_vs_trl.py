"""One GRPO step of this trainer vs TRL's `GRPOTrainer`, same model, same work, on the CPU.

Both sides train the same Hugging Face directory (default SmolLM2-135M-Instruct, from
`models.sources.hf_directory`; `--layers N` keeps only its first N layers, written to a
temporary copy with `transformers`) in float32 on the CPU (`--dtype bfloat16`: both compute
in bf16 over float32 parameters, gradients and Adam state; TRL by torch's CPU autocast), and
do the same work per step:

* the same `--prompts` single-turn prompts: one-operation calculator word problems
  (`envs.calculator.make_problem`, two-digit numbers) + " Reply with the number only.",
  rendered with the model's chat template (ours: `ChatFormatter.first_prompt`; TRL: its
  `apply_chat_template`; the ids are checked equal: `same_prompt_ids`);
* `--group` completions per prompt of exactly `--new-tokens` tokens, sampled at
  temperature 1, top-p 1, no top-k (ours: `Sampler.generate` with no EOS id, so nothing stops
  a row; TRL: `min_new_tokens = max_new_tokens`, which also forbids sampling EOS);
* reward 1 if the reply contains the answer's number, else 0; GRPO advantages
  A = (r − mean_group) / (std_group + ε), std with Bessel's correction;
* one optimizer update on all P·G completions, in micro-batches of `--micro-batch`
  completions (default gcd(8, P·G)), token-mean clipped loss, no KL (β = 0):

      r_t  = exp(logp_t − old_t)
      loss = Σ_t m_t · max(−A·r_t, −A·clip(r_t, 1 − 0.2, 1 + 0.2)) / Σ_t m_t
      g    = clip_by_global_norm(∇loss, 1.0);  θ ← AdamW(θ, g)  (lr `--lr`, no decay)

  (ours `loss_reduction="token_mean"` over the one mini-batch; TRL `loss_type="dapo"`: the
  sum over the generation batch divided by its active-token count, the same thing).

**Ours**: the trainer's own pieces and defaults (`config.default_config` →
`run_config.learner_config`), as `Pipeline.train_step` plays a one-turn episode:
`ChatFormatter` → `Sampler.generate(params=learner.params)` → decode, reward,
`algos.advantages.grpo` → `Sample`s → `Learner.step`; a packed row holds `--micro-batch`
samples (its length rounded up to 128, its loss slots to 64). With tree packing (on, as the
SmolLM2 recipes train; `--no-tree-packing` turns it off) a group's prompt is computed once
per row and prefilled once for the group's members: the same tokens trained, fewer computed
(`computed_tokens`, `prefill_shared_tokens`), exact (data/tree_packing.py). Phases: `generate`,
`rollout_other` (chat template, decoding, rewards, advantages, samples), `logprob`
(`Learner.sample_logprobs`: by default the logprob-mismatch check on 8 samples), `train`
(the update engine: packing, host-to-device copies, jitted forward + backward + AdamW).

**TRL** (`trl==1.16.0`, `transformers`' generate, no vLLM, offline): `GRPOTrainer(model=dir,
args=GRPOConfig(use_cpu=True, bf16=False, gradient_checkpointing=False, ...))` (TRL's
defaults, bf16 and gradient checkpointing, would not be ours). `per_device_train_batch_size
= --micro-batch`, `gradient_accumulation_steps = P·G / --micro-batch`: one generation batch
is one update, and with `num_iterations=1` the old logprobs are the detached current ones
(no extra forward: `logprob` is 0). Phases, timed by wrapping the trainer's methods on the
instance: `generate` (`_generate_single_turn`), `rollout_other` (the rest of
`_prepare_inputs`), `train` = `loss_forward` (`compute_loss`) + `backward` (the rest of
`training_step`) + `clip` (`_clip_grad_norm`) + `optimizer` (`on_pre_optimizer_step` →
`on_optimizer_step`). A step is `on_step_begin` → `on_step_end`.

**Not matched exactly**: the samples (each side draws with its own RNG, so replies and
rewards differ); TRL's ratio is exactly 1 (old = current logprobs), ours is exp(learner −
sampler logprob), 1 to ~1e-5 in fp32; ours may sample EOS mid-reply (it does not stop on
it), TRL cannot; ε is 1e-4 in TRL, 1e-6 here; TRL left-pads each micro-batch's prompts,
ours packs rows (`computed_tokens`); TRL also computes the entropy; TRL's AdamW is torch's
fused one.

**Processes.** Each side runs in its own worker process (this script with `--worker`), so
that peak RSS (`ru_maxrss`) is each side's own and JAX's and torch's thread pools never
share a process. `--threads N` pins both to the same N cores (`sched_setaffinity`, which
also sets XLA's CPU threads) and gives torch N threads (default: every core allowed). The
parent starts one worker, waits for its `--warmup` steps (ours compiles there), then the
other, then asks for `--steps` steps alternately (ours, TRL, TRL, ours, …) so both see the
same background load, and reports medians (`round_s`: every step). `vs_trl` = TRL's median
step / ours. `same_work`: the prompt ids, completions, generated and trained tokens and
updates per step agree (exit code 1 after printing if not). Prints ONE JSON line.

    python scripts/bench/bench_vs_trl.py                      # 8 prompts × 4, 32 tokens, 3 steps
    python scripts/bench/bench_vs_trl.py --layers 2 --prompts 2 --group 2 --new-tokens 4 --steps 1

Needs the `bench` extra (`pip install -e ".[bench]"`: trl, datasets).
"""

from __future__ import annotations

import argparse
import collections
import json
import math
import os
import statistics
import sys
import tempfile
import time

import common
from vs_trl_protocol import (
    Worker,
    command,
    contains_answer,
    emit,
    grpo_learner,
    grpo_samples,
    make_prompts,
    rss_mb,
    truncated_copy,
    version,
)

PHASES = ("generate", "rollout_other", "logprob", "train")
TRL_PHASES = ("loss_forward", "backward", "clip", "optimizer")


def _parse_args(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="smollm2-135m-instruct",
                        help="packaged model name, HF directory or .gguf (models.sources)")
    parser.add_argument("--layers", type=int, default=0,
                        help="keep only the first N layers on both sides (0 = all)")
    parser.add_argument("--prompts", type=int, default=8)
    parser.add_argument("--group", type=int, default=4, help="completions per prompt")
    parser.add_argument("--new-tokens", type=int, default=32,
                        help="tokens per completion (min = max new tokens on both sides)")
    parser.add_argument("--micro-batch", type=int, default=0,
                        help="completions per micro-batch, dividing prompts × group "
                             "(default 0: gcd(8, prompts × group))")
    parser.add_argument("--lr", type=float, default=1e-6)
    parser.add_argument("--steps", type=int, default=3, help="measured steps per side")
    parser.add_argument("--warmup", type=int, default=1, help="untimed steps per side (≥ 1)")
    parser.add_argument("--threads", type=int, default=0,
                        help="cores (and torch threads) per side (0 = all this process may use)")
    parser.add_argument("--dtype", choices=("float32", "bfloat16"), default="float32",
                        help="compute dtype of both sides; parameters, gradients and Adam "
                             "stay float32 (TRL: bf16=True, torch's CPU autocast)")
    parser.add_argument("--no-tree-packing", dest="tree_packing", action="store_false",
                        help="ours without tree packing (share_group_prefix) and the shared "
                             "prefill of a group's prompt: every completion recomputes it, "
                             "as TRL's does")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--worker", choices=("ours", "trl"), help=argparse.SUPPRESS)
    parser.add_argument("--spec", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.worker:
        return args
    completions = args.prompts * args.group
    if min(args.prompts, args.new_tokens, args.steps, args.warmup) < 1 or args.group < 2 \
            or args.micro_batch < 0:
        parser.error("--prompts, --new-tokens, --steps, --warmup must be ≥ 1, --group ≥ 2 "
                     "and --micro-batch ≥ 0")
    args.micro_batch = args.micro_batch or math.gcd(8, completions)
    if completions % args.micro_batch:
        parser.error(f"--micro-batch {args.micro_batch} must divide prompts × group = "
                     f"{completions}")
    return args


# ----------------------------------------------------------------------------- workers


def _ours_worker(spec: dict) -> None:
    common.configure(argv=[])  # JAX_PLATFORMS=cpu unless set: before jax is imported
    import jax
    import numpy as np

    sys.path.insert(0, common.ROOT)
    from jaxrl_agentic.models import load_pretrained
    from jaxrl_agentic.rollout.conversation import ChatFormatter
    from jaxrl_agentic.runtime.compile_events import CompileEvents
    from jaxrl_agentic.sampling import Sampler

    start = time.perf_counter()
    texts, answers = zip(*spec["prompts"], strict=True)
    group, new_tokens, micro = spec["group"], spec["new_tokens"], spec["micro_batch"]
    model, tokenizer = load_pretrained(spec["model_dir"], dtype=spec["dtype"],
                                       param_dtype="float32")
    formatter = ChatFormatter(tokenizer)
    prompt_len = max(len(formatter.first_prompt(t)) for t in texts)
    longest = prompt_len + new_tokens
    learner, row = grpo_learner(
        model, tokenizer, lr=spec["lr"], completions=len(texts) * group, group=group,
        micro=micro, prompt_len=prompt_len, new_tokens=new_tokens, seed=spec["seed"],
        tree_packing=spec["tree_packing"])
    cfg = learner.config
    sampler = Sampler(model, tokenizer, max_total_len=-(-(longest + 1) // 64) * 64,
                      eos_token_id=-1)  # no id stops a row: every reply is new_tokens long
    sampler.set_params(None)  # the learner owns the params, as in the pipeline
    sampler.share_prompt_prefill = spec["tree_packing"]  # as Pipeline sets it
    n_params = int(sum(x.size for x in jax.tree.leaves(learner.params)))
    layers = model.cfg.num_hidden_layers
    del model
    load_s = time.perf_counter() - start
    loaded_rss = rss_mb()["rss_mb"]

    times = collections.defaultdict(float)

    def timed(name, fn):
        def wrapper(*a, **k):
            t0 = time.perf_counter()
            result = fn(*a, **k)
            times[name] += time.perf_counter() - t0
            return result
        return wrapper

    learner.sample_logprobs = timed("logprob", learner.sample_logprobs)
    run, rows = timed("train", learner.engine.run), []

    def counted_run(*a, **k):  # rows holding samples (padding rows are skipped)
        per_update, packed = run(*a, **k)
        rows[:] = [int((b.segment_ids > 0).any(axis=1).sum()) for b in packed]
        return per_update, packed

    learner.engine.run = counted_run

    def step(index: int) -> dict:
        times.clear()
        t0 = time.perf_counter()
        prompt_ids = [formatter.first_prompt(t) for t in texts]
        t1 = time.perf_counter()
        out = sampler.generate(prompt_ids, max_new_tokens=new_tokens, temperature=1.0,
                               top_p=1.0, top_k=0, num_return_sequences=group,
                               seed=spec["seed"] + index, params=learner.params)
        t2 = time.perf_counter()
        rewards = [contains_answer(formatter.decode_reply(ids), answers[k // group])
                   for k, ids in enumerate(out.tokens)]
        samples = grpo_samples(prompt_ids, out, rewards, group)
        t3 = time.perf_counter()
        metrics = learner.step(samples, [spec["lr"]])
        t4 = time.perf_counter()
        if metrics["optim/nonfinite_updates"]:
            raise RuntimeError("Learner.step skipped a non-finite update")
        return {
            "step_s": t4 - t0, "generate": t2 - t1,
            "rollout_other": (t1 - t0) + (t3 - t2),  # the learner's own rest is "other"
            "logprob": times["logprob"], "train": times["train"],
            "completions": len(out.tokens),
            "generated_tokens": sum(len(t) for t in out.tokens),
            "trained_tokens": int(metrics["tokens/loss"]),
            "prompt_tokens": sum(len(p) for p in prompt_ids) * group,
            "computed_tokens": int(metrics["tokens/computed"]),
            "micro_batches": sum(rows),
            "updates": int(metrics["optim/updates_this_step"]),
            "loss": metrics["actor/loss"], "grad_norm": metrics["actor/grad_norm"],
            "reward_mean": float(np.mean(rewards)),
            "logprob_mismatch": metrics["rollout/logprob_mismatch"],
        }

    warm = [step(i)["step_s"] for i in range(spec["warmup"])]
    emit({"ready": True, "load_s": load_s, "warmup_step_s": warm, "rss_after_load_mb": loaded_rss,
          "prompt_ids": [formatter.first_prompt(t) for t in texts],
          "setup": {"params": n_params, "layers": layers, "row_len": row,
                    "loss_slots": cfg.packing.loss_slots_per_row,
                    "rows_bucket": cfg.packing.rows_bucket,
                    "recompute_old_logprobs": cfg.recompute_old_logprobs,
                    "tree_packing": spec["tree_packing"],
                    "prefill_shared_tokens": sampler.stats["prefill_shared_tokens"]},
          "versions": {k: version(k) for k in ("jax", "flax", "transformers")}})
    with CompileEvents() as compiles:
        index = spec["warmup"]
        while command() == "step":
            emit(step(index))
            index += 1
    emit({"compiles_after_warmup": len(compiles.since(0, "compile")), **rss_mb()})


def _trl_worker(spec: dict) -> None:
    import datasets
    import torch
    import transformers
    from trl import GRPOConfig, GRPOTrainer

    transformers.logging.set_verbosity_error()
    torch.set_num_threads(spec["threads"])
    torch.manual_seed(spec["seed"])
    start = time.perf_counter()
    prompts = spec["prompts"]
    group, new_tokens, micro = spec["group"], spec["new_tokens"], spec["micro_batch"]
    dataset = datasets.Dataset.from_list(
        [{"prompt": [{"role": "user", "content": t}], "answer": a} for t, a in prompts])

    def contains_answer_reward(completions, answer, **_):
        return [contains_answer(c[0]["content"], a) for c, a in zip(completions, answer,
                                                                    strict=True)]

    args = GRPOConfig(
        output_dir=os.path.join(spec["tmp"], "trl"), use_cpu=True,
        bf16=spec["dtype"] == "bfloat16", fp16=False,
        gradient_checkpointing=False, model_init_kwargs={"dtype": "float32"}, seed=spec["seed"],
        per_device_train_batch_size=micro,
        gradient_accumulation_steps=len(prompts) * group // micro,
        num_generations=group, max_completion_length=new_tokens,
        generation_kwargs={"min_new_tokens": new_tokens},
        temperature=1.0, top_p=1.0, top_k=0, beta=0.0, epsilon=0.2, loss_type="dapo",
        scale_rewards="group", num_iterations=1, mask_truncated_completions=False,
        learning_rate=spec["lr"], lr_scheduler_type="constant", warmup_steps=0,
        weight_decay=0.0, max_grad_norm=1.0, max_steps=spec["warmup"] + spec["steps"],
        logging_strategy="no", save_strategy="no", report_to="none", disable_tqdm=True,
        dataloader_num_workers=0, log_completions=False)
    trainer = GRPOTrainer(model=spec["model_dir"], reward_funcs=contains_answer_reward,
                          args=args, train_dataset=dataset)
    load_s = time.perf_counter() - start
    loaded_rss = rss_mb()["rss_mb"]

    acc, info, seen_prompts = collections.defaultdict(float), collections.defaultdict(int), []

    def timed(name, fn, after=None):
        def wrapper(*a, **k):
            t0 = time.perf_counter()
            result = fn(*a, **k)
            acc[name] += time.perf_counter() - t0
            if after is not None:
                after(a, result)
            return result
        return wrapper

    def after_generate(a, result):
        for ids in map(lambda ids: list(map(int, ids)), a[0]):  # a prompt per completion
            if ids not in seen_prompts:
                seen_prompts.append(ids)
        info["generated_tokens"] += sum(map(len, result[0]))
        info["completions"] += len(result[0])

    def after_score(a, out):
        info["trained_tokens"] = int(out["num_items_in_batch"])
        info["prompt_tokens"] = int(out["prompt_mask"].sum())
        info["reward_mean"] = float(trainer._metrics["train"]["reward"][-1])

    def after_loss(a, loss):  # padded micro-batch: every row as long as its longest
        ids = a[1]["prompt_ids"]
        info["computed_tokens"] += ids.shape[0] * (ids.shape[1] + a[1]["completion_ids"].shape[1])
        info["micro_batches"] += 1
        info["loss"] += float(loss.detach())

    def after_clip(a, norm):
        info["grad_norm"] = float(norm)

    trainer._generate_single_turn = timed("generate", trainer._generate_single_turn,
                                          after_generate)
    trainer._generate_and_score_completions = timed(
        "rollout", trainer._generate_and_score_completions, after_score)
    trainer._prepare_inputs = timed("prepare_inputs", trainer._prepare_inputs)
    trainer.compute_loss = timed("loss_forward", trainer.compute_loss, after_loss)
    trainer.training_step = timed("training_step", trainer.training_step)
    trainer._clip_grad_norm = timed("clip", trainer._clip_grad_norm, after_clip)

    warm, state = [], {"t0": 0.0, "opt0": 0.0, "measured": False}

    class Steps(transformers.TrainerCallback):
        def on_step_begin(self, args, st, control, **kw):
            if st.global_step == spec["warmup"]:
                emit({"ready": True, "load_s": load_s, "warmup_step_s": warm,
                      "rss_after_load_mb": loaded_rss, "prompt_ids": seen_prompts,
                      "setup": {
                          "optim": str(getattr(args.optim, "value", args.optim)),
                          "attn_implementation": trainer.model.config._attn_implementation,
                          "gradient_checkpointing": any(
                              getattr(m, "gradient_checkpointing", False)
                              for m in trainer.model.modules())},
                      "versions": {k: version(k) for k in (
                          "trl", "transformers", "torch", "accelerate", "datasets")}})
            if st.global_step >= spec["warmup"]:
                if command() != "step":
                    raise SystemExit(0)
                state["measured"] = True
            acc.clear()
            info.clear()
            state["t0"] = time.perf_counter()

        def on_pre_optimizer_step(self, args, st, control, **kw):
            state["opt0"] = time.perf_counter()

        def on_optimizer_step(self, args, st, control, **kw):
            acc["optimizer"] += time.perf_counter() - state["opt0"]
            info["updates"] += 1

        def on_step_end(self, args, st, control, **kw):
            step_s = time.perf_counter() - state["t0"]
            if not state["measured"]:
                warm.append(step_s)
                return
            backward = acc["training_step"] - acc["prepare_inputs"] - acc["loss_forward"]
            train = acc["loss_forward"] + backward + acc["clip"] + acc["optimizer"]
            emit({"step_s": step_s, "generate": acc["generate"], "logprob": 0.0,
                  "rollout_other": acc["prepare_inputs"] - acc["generate"], "train": train,
                  "backward": backward, **{k: acc[k] for k in ("loss_forward", "clip",
                                                                "optimizer")}, **info})

    trainer.add_callback(Steps())
    trainer.train()
    while command() == "step":  # more steps asked for than were planned
        emit({"error": "no steps left"})
    emit({"compiles_after_warmup": None, **rss_mb()})


def _worker(args) -> None:
    with open(args.spec) as f:
        spec = json.load(f)
    cores = sorted(os.sched_getaffinity(0))[:spec["threads"]]
    os.sched_setaffinity(0, cores)  # before jax/torch start their thread pools
    (_ours_worker if args.worker == "ours" else _trl_worker)(spec)


# ----------------------------------------------------------------------------- parent


def _summary(args, spec, ready, rounds, finals, load_before) -> dict:
    def med(side, key):
        values = [r[key] for r in rounds[side] if r.get(key) is not None]
        return statistics.median(values) if values else None

    def r4(x):
        return None if x is None else round(x, 4)

    def per_side(key, digits=None):
        return {s: [v if digits is None or v is None else round(v, digits)
                    for v in (r.get(key) for r in rounds[s])] for s in ("ours", "trl")}

    ours_s, trl_s = med("ours", "step_s"), med("trl", "step_s")
    phases = {side: {k: r4(med(side, k)) for k in PHASES + TRL_PHASES * (side == "trl")}
              for side in rounds}
    for side, p in phases.items():  # what no phase claims
        p["other"] = r4(med(side, "step_s") - sum(p[k] for k in PHASES))
    expected = args.prompts * args.group
    checks = {"same_prompt_ids": sorted(ready["ours"]["prompt_ids"])
              == sorted(ready["trl"]["prompt_ids"])}
    for key in ("completions", "generated_tokens", "trained_tokens", "updates"):
        got = per_side(key)
        checks[f"same_{key}"] = None not in got["ours"] and got["ours"] == got["trl"]
    checks["as_asked"] = all(r["completions"] == expected and r["generated_tokens"]
                             == expected * args.new_tokens for s in rounds for r in rounds[s])

    return {
        "ours_s": r4(ours_s), "trl_s": r4(trl_s),
        "vs_trl": round(trl_s / ours_s, 3),
        "phases_s": phases,
        "vs_trl_by_phase": {k: round(phases["trl"][k] / phases["ours"][k], 3)
                            for k in ("generate", "rollout_other", "train")
                            if phases["ours"][k]},
        "same_work": all(checks.values()),
        "work_checks": checks,
        "work": {"prompts": args.prompts, "group": args.group, "completions": expected,
                 "new_tokens": args.new_tokens, "micro_batch": args.micro_batch,
                 **{k: per_side(k) for k in ("generated_tokens", "trained_tokens",
                                             "prompt_tokens", "computed_tokens",
                                             "micro_batches", "updates")}},
        "peak_rss_mb": {s: finals[s]["peak_rss_mb"] for s in finals},
        "rss_after_load_mb": {s: ready[s]["rss_after_load_mb"] for s in ready},
        "load_s": {s: round(ready[s]["load_s"], 2) for s in ready},
        "warmup_step_s": {s: [round(t, 2) for t in ready[s]["warmup_step_s"]] for s in ready},
        "ours_compiles_after_warmup": finals["ours"]["compiles_after_warmup"],
        "round_s": per_side("step_s", 4),
        "loss": per_side("loss", 6), "grad_norm": per_side("grad_norm", 6),
        "reward_mean": per_side("reward_mean", 3),
        "ours_logprob_mismatch": [r4(r["logprob_mismatch"]) for r in rounds["ours"]],
        "ours_setup": ready["ours"]["setup"], "trl_setup": ready["trl"]["setup"],
        "model": {"source": args.model, "layers": ready["ours"]["setup"]["layers"],
                  "dtype": spec["dtype"]},
        "settings": {"lr": args.lr, "clip": 0.2, "kl_coef": 0.0, "temperature": 1.0,
                     "top_p": 1.0, "ours_loss_reduction": "token_mean",
                     "trl_loss_type": "dapo", "seed": args.seed},
        "threads": spec["threads"],
        "loadavg_1m": [round(load_before, 2), round(os.getloadavg()[0], 2)],
        "timing": f"median of {args.steps} alternating steps per side after {args.warmup} "
                  "warm-up step(s); each side in its own process",
        "versions": {**ready["ours"]["versions"], **ready["trl"]["versions"]},
    }


def main(argv=None) -> dict:
    args = _parse_args(argv)
    if args.worker:
        _worker(args)
        return {}
    sys.path.insert(0, common.ROOT)
    from jaxrl_agentic.models.sources import hf_directory

    load_before = os.getloadavg()[0]
    threads = args.threads or len(os.sched_getaffinity(0))
    with tempfile.TemporaryDirectory(prefix="bench_vs_trl_") as tmp:
        model_dir = hf_directory(args.model)
        if args.layers:
            model_dir = truncated_copy(model_dir, args.layers, os.path.join(tmp, "model"))
        spec = {"model_dir": model_dir,
                "prompts": make_prompts(args.prompts, args.seed), "group": args.group,
                "new_tokens": args.new_tokens, "micro_batch": args.micro_batch, "lr": args.lr,
                "steps": args.steps, "warmup": args.warmup, "threads": threads,
                "seed": args.seed, "tree_packing": args.tree_packing, "dtype": args.dtype,
                "tmp": tmp}
        spec_path = os.path.join(tmp, "spec.json")
        with open(spec_path, "w") as f:
            json.dump(spec, f)
        workers, ready = {}, {}
        try:
            for side in ("ours", "trl"):  # one at a time: warm-ups do not overlap
                print(f"starting the {side} worker", file=sys.stderr, flush=True)
                workers[side] = Worker(side, spec_path, __file__)
                ready[side] = workers[side].read()
            rounds = {"ours": [], "trl": []}
            for i in range(args.steps):
                for side in ("ours", "trl") if i % 2 == 0 else ("trl", "ours"):
                    rounds[side].append(workers[side].ask("step"))
                    print(f"step {i + 1} {side}: {rounds[side][-1]['step_s']:.2f} s",
                          file=sys.stderr, flush=True)
            finals = {side: w.close() for side, w in workers.items()}
        finally:
            for w in workers.values():
                if w.proc.poll() is None:
                    w.proc.kill()
    result = _summary(args, spec, ready, rounds, finals, load_before)
    print(json.dumps(result), flush=True)
    if not result["same_work"]:
        print(f"the two sides did not do the same work: {result['work_checks']}",
              file=sys.stderr)
        raise SystemExit(1)
    return result


if __name__ == "__main__":
    main()
