"""Sampler vs learner logprobs of the same sampled tokens, in bf16 compute, against the
float32 model: the precision of the logits path at a real model's shape. Prints one JSON line.

    python scripts/analysis/bf16_gap.py --model /tmp/qwen24 [--prompts 4] [--prompt-len 300]

`--prompts` random-token prompts of `--prompt-len` tokens each get `--new-tokens` sampled
tokens (T = 1) from `Sampler.generate` (prefill, then one-token decode steps against the KV
cache); the learner recomputes their logprobs from rows of `--row` packed tokens
(`Learner.sample_logprobs`). Reports the mean / max absolute difference (`gap`), the
fraction of tokens whose two logprobs are the same float32 (`equal_fraction`), and each
side's mean absolute distance from the float32 model's recomputation (`--no-fp32` skips it).
"""

from __future__ import annotations

import argparse
import json
import os
import sys

import numpy as np

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, ROOT)


def sampled_samples(model, prompts, new_tokens: int):
    """`Sample`s of each prompt and `new_tokens` tokens sampled from `model` (T = 1, no EOS),
    with the sampler's logprobs as `old_logprobs` and the reply as the loss tokens."""
    from jaxrl_agentic.data import Sample
    from jaxrl_agentic.sampling import Sampler

    longest = max(len(p) for p in prompts)
    out = Sampler(model, max_total_len=longest + new_tokens + 32, eos_token_id=-1).generate(
        prompts, max_new_tokens=new_tokens, temperature=1.0, seed=1)
    samples = []
    for prompt, tokens, logprobs in zip(prompts, out.tokens, out.logprobs, strict=True):
        mask = np.r_[np.zeros(len(prompt)), np.ones(len(tokens))]
        samples.append(Sample(tokens=np.array(list(prompt) + list(tokens)), loss_mask=mask,
                              old_logprobs=np.r_[np.zeros(len(prompt)), logprobs],
                              advantages=mask, prompt_len=len(prompt)))
    return samples


def recomputed(model, samples, row: int, sample_align: int) -> np.ndarray:
    """The learner's logprobs of the samples' loss tokens (rows of `row` packed tokens, each
    sample at a multiple of `sample_align`), concatenated."""
    from flax import nnx

    from jaxrl_agentic.data import PackingConfig
    from jaxrl_agentic.training.learner import Learner
    from jaxrl_agentic.training.learner_config import LearnerConfig

    graphdef, params = nnx.split(model)
    packing = PackingConfig(micro_batch_max_tokens=row, sequence_length=row,
                            sample_align=sample_align)
    values = Learner(graphdef, params, LearnerConfig(packing=packing)).sample_logprobs(samples)
    return loss_token_values(values, samples)


def loss_token_values(values, samples) -> np.ndarray:
    return np.concatenate([np.asarray(v)[s.loss_mask > 0] for v, s in
                           zip(values, samples, strict=True)])


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", required=True)
    parser.add_argument("--prompts", type=int, default=4)
    parser.add_argument("--prompt-len", type=int, default=300)
    parser.add_argument("--new-tokens", type=int, default=32)
    parser.add_argument("--row", type=int, default=2048)
    parser.add_argument("--sample-align", type=int, default=128,
                        help="PackingConfig.sample_align of the learner's rows (1 = tight)")
    parser.add_argument("--no-fp32", action="store_true")
    args = parser.parse_args(argv)

    from jaxrl_agentic.models import load_pretrained

    model, _ = load_pretrained(args.model, dtype="bfloat16", param_dtype="float32")
    rng = np.random.default_rng(0)
    prompts = [rng.integers(0, model.cfg.vocab_size - 1000, args.prompt_len).tolist()
               for _ in range(args.prompts)]
    samples = sampled_samples(model, prompts, args.new_tokens)
    sampled = loss_token_values([s.old_logprobs for s in samples], samples)
    learner = recomputed(model, samples, args.row, args.sample_align)
    result = {"model": args.model, "layers": model.cfg.num_hidden_layers,
              "prompts": args.prompts, "prompt_len": args.prompt_len,
              "new_tokens": args.new_tokens, "row": args.row,
              "sample_align": args.sample_align,
              "gap_mean": float(np.abs(sampled - learner).mean()),
              "gap_max": float(np.abs(sampled - learner).max()),
              "equal_fraction": float(np.mean(sampled == learner)),
              "mean_logprob": float(sampled.mean())}
    if not args.no_fp32:
        model32, _ = load_pretrained(args.model, dtype="float32", param_dtype="float32")
        exact = recomputed(model32, samples, args.row, args.sample_align)
        result["learner_vs_fp32"] = float(np.abs(learner - exact).mean())
        result["sampler_vs_fp32"] = float(np.abs(sampled - exact).mean())
    print(json.dumps(result))
    return 0


if __name__ == "__main__":
    sys.exit(main())
