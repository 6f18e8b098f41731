"""Learning per minute: held-out accuracy against training wall-clock, this trainer vs TRL.

    python scripts/analysis/learning_vs_trl.py [--minutes 30] [--eval-every 4] \
        [--eval-prompts 64] [--prompts 8] [--group 4] [--lr 1e-5] [--plot out.png]
    python scripts/analysis/learning_vs_trl.py --layers 2 --minutes 1 --eval-every 2 \
        --eval-prompts 8 --prompts 2 --group 2                     # a smoke test

The task, model and loss of `scripts/bench/bench_vs_trl.py` (its docstring has the details),
trained instead of timed: SmolLM2-135M-Instruct (`--layers N`: its first N layers), fp32 on
the CPU, one-operation two-digit arithmetic word problems + " Reply with the number only.",
reward 1 if the reply contains the answer's number; GRPO advantages
A = (r − mean_group) / (std_group + ε); one update per step on all P·G completions in
micro-batches of `--micro-batch`, token-mean clipped loss, no KL:

    loss = Σ_t m_t · max(−A·r_t, −A·clip(r_t, 1 − 0.2, 1 + 0.2)) / Σ_t m_t
    g    = clip_by_global_norm(∇loss, 1.0);  θ ← AdamW(θ, g)  (lr `--lr`, no decay)

**Ours**: `Sampler.generate` (stopping at the tokenizer's EOS, which is trained as the last
reply token, as TRL's completion mask does) + `Learner.step` with tree packing, as the bench
builds them. **TRL** 1.16 `GRPOTrainer`, configured as the bench does but without
`min_new_tokens` (a reply stops at EOS) and with `shuffle_dataset=False`, so that it takes
the prompts in order.

**Data.** A stream of fresh problems (`make_prompts(max_steps · P, --seed)`), step i taking
problems i·P … i·P + P − 1 on both sides (checked: `same_stream`, the prompt ids of every
step agree); held-out: `--eval-prompts` problems of seed `--seed + 1000`, whose texts are
removed from the training stream. Eval, at step 0 and every `--eval-every` steps of a side
(and after its last): greedy, up to `--new-tokens` tokens, stopping at EOS, one batch;
accuracy = mean of `contains_answer`.

**Hyperparameters** (the same on both sides): lr 1e-5 AdamW, no decay, no warm-up (a full
fine-tune of a 135M model: 1e-6, the bench's, moves the policy too little in the few dozen
steps half an hour holds on one core, ~50 s a step, to show a curve; much above 1e-5,
full-parameter GRPO on a small model tends to break its format), clip 0.2 and β = 0 (the
bench's, and DAPO's: no reference model to keep), grad-norm 1.0, temperature 1 and top-p 1
(sampling from the policy itself), 32 new tokens (a bare answer takes under 8; a reply that
reasons first is cut off before its number, so the reward favours answering as the prompt
asks), 8 prompts × 4 (the bench's step).

**Clock.** Each side's clock is the sum of its training steps' wall time, as its worker
measures it (bench_vs_trl's `step_s`: ours from the chat template to the update, TRL from
`on_step_begin` to `on_step_end`); eval time is excluded and reported apart (`eval_s`). A
side trains until its clock passes `--minutes` (or `--max-steps`). Ours compiles in its
first steps (and again on a new shape): that time counts, as it does for a user
(`first_step_s`, `ours_compiles`). Both sides run in their own worker process, on the
cores this process may use (`taskset`), interleaved a step at a time (ours, TRL, TRL, ours,
…): only one computes at any moment, and both see the same background load.

Prints ONE JSON line: per side `curve` [[train_minutes, step, eval_accuracy], ...], `steps`,
`step_s_median`, `eval_s` (total), `train_reward` (mean training reward between evals);
`--plot FILE.png` draws both curves (matplotlib, as `plot_curves.py` draws).

Needs the `bench` extra (`pip install -e ".[bench]"`: trl, datasets).
"""

from __future__ import annotations

import argparse
import hashlib
import json
import math
import os
import statistics
import sys
import tempfile
import time

sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))),
                                "bench"))
import common  # noqa: E402  (scripts/bench is not a package)
import vs_trl_protocol as protocol  # noqa: E402

SIDES = ("ours", "trl")
EVAL_SEED_OFFSET = 1000


def _parse_args(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="smollm2-135m-instruct",
                        help="packaged model name, HF directory or .gguf (models.sources)")
    parser.add_argument("--layers", type=int, default=0,
                        help="keep only the first N layers on both sides (0 = all)")
    parser.add_argument("--minutes", type=float, default=30.0,
                        help="training wall-clock per side (eval excluded)")
    parser.add_argument("--max-steps", type=int, default=500,
                        help="steps per side at most (the training stream holds this many)")
    parser.add_argument("--eval-every", type=int, default=4, help="steps between evals")
    parser.add_argument("--eval-prompts", type=int, default=64)
    parser.add_argument("--prompts", type=int, default=8, help="prompts per step")
    parser.add_argument("--group", type=int, default=4, help="completions per prompt")
    parser.add_argument("--new-tokens", type=int, default=32, help="max new tokens per reply")
    parser.add_argument("--micro-batch", type=int, default=0,
                        help="completions per micro-batch (default gcd(8, prompts × group))")
    parser.add_argument("--lr", type=float, default=1e-5)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--plot", default=None, help="write the curves to this PNG")
    parser.add_argument("--worker", choices=SIDES, help=argparse.SUPPRESS)
    parser.add_argument("--spec", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.worker:
        return args
    completions = args.prompts * args.group
    if min(args.prompts, args.new_tokens, args.eval_every, args.eval_prompts,
           args.max_steps) < 1 or args.group < 2 or args.micro_batch < 0 or args.minutes <= 0:
        parser.error("--prompts, --new-tokens, --eval-every, --eval-prompts, --max-steps "
                     "must be ≥ 1, --group ≥ 2, --micro-batch ≥ 0 and --minutes > 0")
    args.micro_batch = args.micro_batch or math.gcd(8, completions)
    if completions % args.micro_batch:
        parser.error(f"--micro-batch {args.micro_batch} must divide prompts × group = "
                     f"{completions}")
    return args


def _digest(id_lists) -> str:
    """A short hash of a step's prompts (token id lists, order kept)."""
    return hashlib.sha1(json.dumps([list(map(int, ids)) for ids in id_lists])
                        .encode()).hexdigest()[:16]


def _unique(id_lists) -> list[list[int]]:
    """The distinct lists of `id_lists` in first-seen order (a group's prompt once)."""
    out = []
    for ids in map(lambda x: list(map(int, x)), id_lists):
        if ids not in out:
            out.append(ids)
    return out


def _eval_result(replies, answers, seconds: float) -> dict:
    scores = [protocol.contains_answer(r, a) for r, a in zip(replies, answers, strict=True)]
    return {"accuracy": sum(scores) / len(scores), "eval_s": seconds,
            "mean_reply_chars": sum(map(len, replies)) / len(replies),
            "examples": [r[:60] for r in replies[:3]]}


# ----------------------------------------------------------------------------- workers


def _ours_worker(spec: dict) -> None:
    common.configure(argv=[])  # JAX_PLATFORMS=cpu unless set: before jax is imported
    import numpy as np

    sys.path.insert(0, common.ROOT)
    from jaxrl_agentic.models import load_pretrained
    from jaxrl_agentic.rollout.conversation import ChatFormatter
    from jaxrl_agentic.runtime.compile_events import CompileEvents
    from jaxrl_agentic.sampling import Sampler

    stream, evals = spec["stream"], spec["eval"]
    group, new_tokens, micro, n_prompts = (spec["group"], spec["new_tokens"],
                                           spec["micro_batch"], spec["prompts"])
    model, tokenizer = load_pretrained(spec["model_dir"], dtype="float32")
    formatter = ChatFormatter(tokenizer)
    eval_ids = [formatter.first_prompt(t) for t, _ in evals]
    longest_prompt = max(max(len(formatter.first_prompt(t)) for t, _ in stream),
                         max(map(len, eval_ids)))
    longest = longest_prompt + new_tokens
    learner, _ = protocol.grpo_learner(
        model, tokenizer, lr=spec["lr"], completions=n_prompts * group, group=group,
        micro=micro, prompt_len=longest_prompt, new_tokens=new_tokens, seed=spec["seed"],
        tree_packing=True)  # as the SmolLM2 recipes and the bench train
    # The tokenizer's EOS ends a reply (eos_token_id=None: the sampler reads it).
    sampler = Sampler(model, tokenizer, max_total_len=-(-(longest + 1) // 64) * 64)
    sampler.set_params(None)  # the learner owns the params, as in the pipeline
    sampler.share_prompt_prefill = True
    del model

    def step(index: int) -> dict:
        t0 = time.perf_counter()
        batch = stream[index * n_prompts:(index + 1) * n_prompts]
        prompt_ids = [formatter.first_prompt(t) for t, _ in batch]
        out = sampler.generate(prompt_ids, max_new_tokens=new_tokens, temperature=1.0,
                               top_p=1.0, top_k=0, num_return_sequences=group,
                               seed=spec["seed"] + index, params=learner.params)
        rewards = [protocol.contains_answer(formatter.decode_reply(ids), batch[k // group][1])
                   for k, ids in enumerate(out.tokens)]
        samples = protocol.grpo_samples(prompt_ids, out, rewards, group)
        metrics = learner.step(samples, [spec["lr"]])
        if metrics["optim/nonfinite_updates"]:
            raise RuntimeError("Learner.step skipped a non-finite update")
        return {"step_s": time.perf_counter() - t0, "prompts": _digest(_unique(prompt_ids)),
                "reward_mean": float(np.mean(rewards)),
                "reply_tokens": sum(map(len, out.tokens)) / len(out.tokens),
                "trained_tokens": int(metrics["tokens/loss"]),
                "updates": int(metrics["optim/updates_this_step"])}

    def evaluate() -> dict:
        t0 = time.perf_counter()
        out = sampler.generate(eval_ids, max_new_tokens=new_tokens, greedy=True,
                               params=learner.params)
        replies = [formatter.decode_reply(ids) for ids in out.tokens]
        return {**_eval_result(replies, [a for _, a in evals], time.perf_counter() - t0),
                "prompts": _digest(eval_ids)}

    protocol.emit({"ready": True})
    index = 0
    with CompileEvents() as compiles:
        while (command := protocol.command()) != "stop":
            if command == "step":
                protocol.emit(step(index))
                index += 1
            else:
                protocol.emit(evaluate())
        protocol.emit({"compiles": len(compiles.since(0, "compile")), **protocol.rss_mb()})


def _trl_worker(spec: dict) -> None:
    import datasets
    import torch
    import transformers
    from trl import GRPOConfig, GRPOTrainer

    transformers.logging.set_verbosity_error()
    torch.set_num_threads(spec["threads"])
    torch.manual_seed(spec["seed"])
    stream, evals = spec["stream"], spec["eval"]
    group, new_tokens, micro, n_prompts = (spec["group"], spec["new_tokens"],
                                           spec["micro_batch"], spec["prompts"])
    dataset = datasets.Dataset.from_list(
        [{"prompt": [{"role": "user", "content": t}], "answer": a} for t, a in stream])
    rewards_seen = []

    def contains_answer_reward(completions, answer, **_):
        scores = [protocol.contains_answer(c[0]["content"], a)
                  for c, a in zip(completions, answer, strict=True)]
        rewards_seen.extend(scores)
        return scores

    args = GRPOConfig(
        output_dir=os.path.join(spec["tmp"], "trl"), use_cpu=True, bf16=False, fp16=False,
        gradient_checkpointing=False, model_init_kwargs={"dtype": "float32"}, seed=spec["seed"],
        per_device_train_batch_size=micro,
        gradient_accumulation_steps=n_prompts * group // micro,
        num_generations=group, max_completion_length=new_tokens,
        temperature=1.0, top_p=1.0, top_k=0, beta=0.0, epsilon=0.2, loss_type="dapo",
        scale_rewards="group", num_iterations=1, mask_truncated_completions=False,
        shuffle_dataset=False,  # the stream in order: step i gets prompts i·P … i·P + P − 1
        learning_rate=spec["lr"], lr_scheduler_type="constant", warmup_steps=0,
        weight_decay=0.0, max_grad_norm=1.0, max_steps=len(stream) // n_prompts,
        logging_strategy="no", save_strategy="no", report_to="none", disable_tqdm=True,
        dataloader_num_workers=0, log_completions=False)
    trainer = GRPOTrainer(model=spec["model_dir"], reward_funcs=contains_answer_reward,
                          args=args, train_dataset=dataset)
    tokenizer = trainer.processing_class
    eval_texts = [tokenizer.apply_chat_template([{"role": "user", "content": t}],
                                                add_generation_prompt=True, tokenize=False)
                  for t, _ in evals]
    step_info = {"prompts": [], "tokens": 0, "completions": 0, "trained": 0}

    def after_generate(fn):
        def wrapper(*a, **k):
            result = fn(*a, **k)
            step_info["prompts"].extend(a[0])  # a prompt per completion
            step_info["tokens"] += sum(map(len, result[0]))
            step_info["completions"] += len(result[0])
            return result
        return wrapper

    def after_score(fn):
        def wrapper(*a, **k):
            out = fn(*a, **k)
            step_info["trained"] += int(out["num_items_in_batch"])
            return out
        return wrapper

    trainer._generate_single_turn = after_generate(trainer._generate_single_turn)
    trainer._generate_and_score_completions = after_score(
        trainer._generate_and_score_completions)

    def evaluate() -> dict:
        t0 = time.perf_counter()
        model = trainer.accelerator.unwrap_model(trainer.model)
        was_training = model.training
        model.eval()
        side = tokenizer.padding_side
        tokenizer.padding_side = "left"
        enc = tokenizer(eval_texts, return_tensors="pt", padding=True, add_special_tokens=False)
        tokenizer.padding_side = side
        with torch.no_grad():
            out = model.generate(**enc, max_new_tokens=new_tokens, do_sample=False,
                                 temperature=None, top_p=None, top_k=None,
                                 eos_token_id=tokenizer.eos_token_id,
                                 pad_token_id=tokenizer.pad_token_id)
        model.train(was_training)
        replies = tokenizer.batch_decode(out[:, enc["input_ids"].shape[1]:],
                                         skip_special_tokens=True)
        ids = [row[mask.bool()].tolist() for row, mask in zip(enc["input_ids"],
                                                              enc["attention_mask"],
                                                              strict=True)]
        return {**_eval_result(replies, [a for _, a in evals], time.perf_counter() - t0),
                "prompts": _digest(ids)}

    def serve() -> None:
        """Answers eval commands until one asks for a step; ends the process on "stop"."""
        while (command := protocol.command()) != "step":
            if command == "stop":
                protocol.emit({"compiles": None, **protocol.rss_mb()})
                sys.__stdout__.flush()
                os._exit(0)  # out of trainer.train() without its teardown
            protocol.emit(evaluate())

    state = {"t0": 0.0}

    class Steps(transformers.TrainerCallback):
        def on_step_begin(self, args, st, control, **kw):
            serve()
            step_info.update(prompts=[], tokens=0, completions=0, trained=0)
            rewards_seen.clear()
            state["t0"] = time.perf_counter()

        def on_step_end(self, args, st, control, **kw):
            step_s = time.perf_counter() - state["t0"]
            protocol.emit({"step_s": step_s, "prompts": _digest(_unique(step_info["prompts"])),
                           "reward_mean": sum(rewards_seen) / max(1, len(rewards_seen)),
                           "reply_tokens": step_info["tokens"] / max(1, step_info["completions"]),
                           "trained_tokens": step_info["trained"], "updates": 1})

    trainer.add_callback(Steps())
    protocol.emit({"ready": True})
    trainer.train()
    while True:  # the stream is used up: evals still answered, steps refused
        serve()
        protocol.emit({"error": "the training stream is used up (raise --max-steps)"})


def _worker(args) -> None:
    with open(args.spec) as f:
        spec = json.load(f)
    (_ours_worker if args.worker == "ours" else _trl_worker)(spec)


# ----------------------------------------------------------------------------- parent


def training_stream(n: int, seed: int, held_out: set[str]) -> list[tuple[str, int]]:
    """`n` problems of `make_prompts`' seed `seed`, skipping those whose text is held out."""
    out, size = [], n
    while len(out) < n:
        out = [p for p in protocol.make_prompts(size, seed) if p[0] not in held_out][:n]
        size += n - len(out)
    return out


def draw(path: str, curves: dict[str, list], title: str) -> None:
    """Eval accuracy against training minutes, a line per side (Agg, as plot_curves.py)."""
    import matplotlib
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    fig = Figure(figsize=(8.0, 4.5), dpi=150)
    FigureCanvasAgg(fig)  # the Agg backend for this figure only; pyplot's state is untouched
    ax = fig.add_subplot()
    colors = matplotlib.rcParams["axes.prop_cycle"].by_key()["color"]
    labels = {"ours": "jaxrl_agentic (Sampler + Learner, tree packing)",
              "trl": "TRL GRPOTrainer"}
    for i, side in enumerate(SIDES):
        xs, ys = [p[0] for p in curves[side]], [p[2] for p in curves[side]]
        ax.plot(xs, ys, color=colors[i], marker="o", markersize=3, linewidth=1.8,
                label=labels[side])
    ax.set_ylim(-0.02, 1.02)
    ax.set_xlabel("training wall-clock (minutes; eval excluded)")
    ax.set_ylabel("greedy held-out accuracy")
    ax.set_title(title)
    ax.grid(True, alpha=0.3)
    ax.legend(loc="best", fontsize="small")
    fig.tight_layout()
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    fig.savefig(path, format="png", dpi=150, metadata={"Software": None})


def main(argv=None) -> dict:
    args = _parse_args(argv)
    if args.worker:
        _worker(args)
        return {}
    sys.path.insert(0, common.ROOT)
    from jaxrl_agentic.models.sources import hf_directory

    load_before = os.getloadavg()[0]
    cores = sorted(os.sched_getaffinity(0))
    evals = protocol.make_prompts(args.eval_prompts, args.seed + EVAL_SEED_OFFSET)
    stream = training_stream(args.max_steps * args.prompts, args.seed, {t for t, _ in evals})
    budget = args.minutes * 60.0
    with tempfile.TemporaryDirectory(prefix="learning_vs_trl_") as tmp:
        model_dir = hf_directory(args.model)
        if args.layers:
            model_dir = protocol.truncated_copy(model_dir, args.layers, os.path.join(tmp, "model"))
        spec = {"model_dir": model_dir, "stream": stream, "eval": evals,
                "prompts": args.prompts, "group": args.group, "new_tokens": args.new_tokens,
                "micro_batch": args.micro_batch, "lr": args.lr, "seed": args.seed,
                "threads": len(cores), "tmp": tmp}
        spec_path = os.path.join(tmp, "spec.json")
        with open(spec_path, "w") as f:
            json.dump(spec, f)
        workers, rounds, evals_done = {}, {s: [] for s in SIDES}, {s: [] for s in SIDES}
        train_s = {s: 0.0 for s in SIDES}

        def evaluate(side: str) -> None:
            result = workers[side].ask("eval")
            steps = len(rounds[side])
            rewards = [r["reward_mean"] for r in rounds[side][
                evals_done[side][-1]["step"] if evals_done[side] else 0:]]
            evals_done[side].append({**result, "step": steps, "minutes": train_s[side] / 60,
                                     "train_reward": statistics.fmean(rewards) if rewards
                                     else None})
            print(f"{side} step {steps} ({train_s[side] / 60:.1f} min): eval accuracy "
                  f"{result['accuracy']:.3f} in {result['eval_s']:.1f} s; e.g. "
                  f"{result['examples'][0]!r}", file=sys.stderr, flush=True)

        try:
            for side in SIDES:  # one at a time: loading does not overlap
                print(f"starting the {side} worker", file=sys.stderr, flush=True)
                workers[side] = protocol.Worker(side, spec_path, __file__)
                workers[side].read()
            for side in SIDES:
                evaluate(side)

            def active(side):
                return train_s[side] < budget and len(rounds[side]) < args.max_steps

            i = 0
            while any(map(active, SIDES)):
                for side in SIDES if i % 2 == 0 else SIDES[::-1]:
                    if not active(side):
                        continue
                    result = workers[side].ask("step")
                    if "error" in result:
                        raise SystemExit(f"{side}: {result['error']}")
                    rounds[side].append(result)
                    train_s[side] += result["step_s"]
                    n = len(rounds[side])
                    print(f"{side} step {n}: {result['step_s']:.2f} s, reward "
                          f"{result['reward_mean']:.2f}", file=sys.stderr, flush=True)
                    if n % args.eval_every == 0 or not active(side):
                        evaluate(side)
                i += 1
            finals = {side: w.close() for side, w in workers.items()}
        finally:
            for w in workers.values():
                if w.proc.poll() is None:
                    w.proc.kill()

    shared = min(len(rounds["ours"]), len(rounds["trl"]))
    same_stream = all(rounds["ours"][k]["prompts"] == rounds["trl"][k]["prompts"]
                      for k in range(shared))
    same_eval = len({e["prompts"] for s in SIDES for e in evals_done[s]}) == 1

    def side_summary(side):
        steps = [r["step_s"] for r in rounds[side]]
        return {
            "curve": [[round(e["minutes"], 3), e["step"], round(e["accuracy"], 4)]
                      for e in evals_done[side]],
            "steps": len(steps), "train_minutes": round(train_s[side] / 60, 3),
            "step_s_median": round(statistics.median(steps), 3),
            "first_step_s": round(steps[0], 2),
            "eval_s": round(sum(e["eval_s"] for e in evals_done[side]), 1),
            "train_reward": [None if e["train_reward"] is None else round(e["train_reward"], 3)
                             for e in evals_done[side]],
            "reply_tokens_mean": round(statistics.fmean(r["reply_tokens"]
                                                        for r in rounds[side]), 2),
            "eval_reply_chars": [round(e["mean_reply_chars"], 1) for e in evals_done[side]],
            "last_eval_examples": evals_done[side][-1]["examples"],
            "compiles": finals[side]["compiles"], "peak_rss_mb": finals[side]["peak_rss_mb"],
        }

    result = {
        "ours": side_summary("ours"), "trl": side_summary("trl"),
        "same_stream": same_stream, "same_eval_prompts": same_eval,
        "settings": {"model": args.model, "layers": args.layers, "minutes": args.minutes,
                     "eval_every": args.eval_every, "eval_prompts": args.eval_prompts,
                     "prompts": args.prompts, "group": args.group,
                     "new_tokens": args.new_tokens, "micro_batch": args.micro_batch,
                     "lr": args.lr, "clip": 0.2, "kl_coef": 0.0, "temperature": 1.0,
                     "seed": args.seed, "eval_seed": args.seed + EVAL_SEED_OFFSET},
        "cores": cores, "loadavg_1m": [round(load_before, 2), round(os.getloadavg()[0], 2)],
    }
    if args.plot:
        draw(args.plot, {s: result[s]["curve"] for s in SIDES},
             f"GRPO, two-digit arithmetic: {args.model}"
             + (f" ({args.layers} layers)" if args.layers else "")
             + f", lr {args.lr:g}, {args.prompts}×{args.group}/step")
        result["plot"] = args.plot
    print(json.dumps(result), flush=True)
    if not (same_stream and same_eval):
        print("the two sides did not see the same prompts (same_stream / same_eval_prompts)",
              file=sys.stderr)
        raise SystemExit(1)
    return result


if __name__ == "__main__":
    main()
