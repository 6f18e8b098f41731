"""The task and the worker protocol of `bench_vs_trl.py` and `learning_vs_trl.py`.

The task: one-operation calculator word problems with two-digit numbers and "Reply with the
number only." (`make_prompts`), scored 1 when the reply holds the answer (`contains_answer`).
Ours: `grpo_learner` builds this trainer's learner for the task (its defaults, then the
comparison's settings) and `grpo_samples` turns a step's completions into GRPO samples.
The protocol: the parent starts each side as its own process (`Worker`: the script again,
with `--worker SIDE --spec PATH`), writes one command a line on its stdin ("step", "stop",
…), and reads back one JSON object per command from the lines that start with `MARK`
(`emit`); whatever else a worker prints goes to the parent's stderr.
"""

from __future__ import annotations

import json
import os
import random
import re
import resource
import subprocess
import sys

MARK = "@@bench "  # a worker's result lines; anything else it prints goes to stderr


def contains_answer(reply: str, answer: int) -> float:
    """1.0 if an integer in `reply` (commas between digits ignored) equals `answer`."""
    numbers = re.findall(r"-?\d+", re.sub(r"(?<=\d),(?=\d{3})", "", reply))
    return float(any(int(n) == answer for n in numbers))


def make_prompts(n: int, seed: int) -> list[tuple[str, int]]:
    """(user message, answer) of `n` one-operation calculator problems."""
    from jaxrl_agentic.envs.calculator import make_problem

    out = []
    for i in range(n):
        text, _, answer = make_problem(random.Random(f"bench_vs_trl:{seed}:{i}"), 1,
                                       "two_digit")
        out.append((f"{text} Reply with the number only.", answer))
    return out


def truncated_copy(src: str, layers: int, dst: str) -> str:
    """`src` with only its first `layers` decoder layers, saved to `dst` (model + tokenizer);
    `src` itself when it has no more layers than that."""
    import torch
    import transformers

    cfg = transformers.AutoConfig.from_pretrained(src)
    if layers >= cfg.num_hidden_layers:
        return src
    cfg.num_hidden_layers = layers
    if getattr(cfg, "layer_types", None):
        cfg.layer_types = cfg.layer_types[:layers]
    model = transformers.AutoModelForCausalLM.from_pretrained(src, config=cfg,
                                                              dtype=torch.float32)
    model.save_pretrained(dst)
    transformers.AutoTokenizer.from_pretrained(src).save_pretrained(dst)
    return dst


def grpo_learner(model, tokenizer, *, lr: float, completions: int, group: int, micro: int,
                 prompt_len: int, new_tokens: int, seed: int, tree_packing: bool):
    """(our `Learner` on `model`'s parameters, its row length): the trainer's defaults, then
    GRPO as both sides run it (token mean, clip 0.2, no KL or entropy term, no weight decay,
    gradients clipped to norm 1, one update on all `completions` in one mini-batch, constant
    `lr`). A row holds one micro-batch: `micro` samples of ≤ prompt_len + new_tokens tokens,
    or with tree packing (as the SmolLM2 recipes train: exact, data/tree_packing.py) the
    prompts of the groups they belong to once and their `micro` completions."""
    from flax import nnx

    from jaxrl_agentic.config import default_config, env_spec
    from jaxrl_agentic.run_config import learner_config
    from jaxrl_agentic.training.learner import Learner

    need = (-(-micro // group) * prompt_len + micro * new_tokens if tree_packing
            else micro * (prompt_len + new_tokens))
    row = -(-need // 128) * 128
    c = default_config()
    c.learning_rate, c.lr_scheduler_type, c.warmup_steps = lr, "constant", 0
    c.mini_batch_size, c.ppo_epochs = completions, 1
    c.init_kl_coef, c.entropy_loss_coef, c.loss_reduction, c.pg_clip = 0.0, 0.0, "token_mean", 0.2
    c.weight_decay, c.max_grad_norm, c.seed = 0.0, 1.0, seed
    c.sequence_length = c.micro_batch_max_tokens = row
    c.micro_batch_max_loss_tokens = min(row, -(-micro * new_tokens // 64) * 64)
    c.custom_envs = {"arith": env_spec("arith", max_turns=1, max_tokens_per_step=new_tokens)}
    c.share_group_prefix = tree_packing
    pad_id = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else 0
    graphdef, params = nnx.split(model)
    return Learner(graphdef, params, learner_config(c, pad_id)), row


def grpo_samples(prompt_ids, out, rewards, group: int) -> list:
    """One `Sample` per completion of `out` (`Sampler.generate`'s, `group` per prompt in
    order): prompt + reply, loss on the reply, the sampler's logprobs as π_old, GRPO's
    A = (r − mean_group) / (std_group + ε) on every reply token."""
    import numpy as np

    from jaxrl_agentic.algos.advantages import grpo
    from jaxrl_agentic.data import Sample

    advantages = grpo(rewards, [k // group for k in range(len(rewards))], use_std=True)
    samples = []
    for k, (ids, logprobs) in enumerate(zip(out.tokens, out.logprobs, strict=True)):
        prompt = prompt_ids[k // group]
        mask = np.r_[np.zeros(len(prompt)), np.ones(len(ids))].astype(np.float32)
        samples.append(Sample(
            tokens=list(prompt) + list(ids), loss_mask=mask,
            old_logprobs=np.r_[np.zeros(len(prompt)), logprobs],
            advantages=mask * advantages[k], traj_id=k, prompt_len=len(prompt)))
    return samples


def emit(obj) -> None:
    """One result line for the parent (`Worker.read`)."""
    sys.__stdout__.write(MARK + json.dumps(obj) + "\n")
    sys.__stdout__.flush()


def command() -> str:
    """The parent's next command ("stop" once its pipe closes)."""
    line = sys.stdin.readline()
    return line.strip() if line else "stop"


def rss_mb() -> dict:
    """Peak RSS of this process so far (ru_maxrss) and its current RSS, in MiB."""
    with open("/proc/self/statm") as f:
        current = int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE") / 2**20
    return {"peak_rss_mb": round(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024, 1),
            "rss_mb": round(current, 1)}


def version(name: str) -> str:
    from importlib import metadata

    try:
        return metadata.version(name)
    except metadata.PackageNotFoundError:
        return "missing"


class Worker:
    """One side's worker process, ``script --worker SIDE --spec PATH``: commands on its
    stdin, ``MARK`` lines back on its stdout."""

    def __init__(self, side: str, spec_path: str, script: str):
        env = dict(os.environ, JAX_PLATFORMS=os.environ.get("JAX_PLATFORMS", "cpu"),
                   HF_HUB_OFFLINE="1", HF_DATASETS_OFFLINE="1", TRANSFORMERS_OFFLINE="1",
                   TOKENIZERS_PARALLELISM="false")
        self.side = side
        self.proc = subprocess.Popen(
            [sys.executable, os.path.abspath(script), "--worker", side, "--spec", spec_path],
            stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True, env=env)

    def read(self) -> dict:
        for line in self.proc.stdout:
            if line.startswith(MARK):
                return json.loads(line[len(MARK):])
            sys.stderr.write(line)
        raise SystemExit(f"the {self.side} worker ended (exit code {self.proc.wait()}) "
                         "before answering; its log is above")

    def ask(self, request: str) -> dict:
        self.proc.stdin.write(request + "\n")
        self.proc.stdin.flush()
        return self.read()

    def close(self) -> dict:
        final = self.ask("stop")
        self.proc.stdin.close()
        self.proc.wait(timeout=120)
        return final
