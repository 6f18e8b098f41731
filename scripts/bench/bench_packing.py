"""Packed vs padded learner batches on real step-wise rollouts of the tiny model.

1. Plays ``--groups × --group-size`` frozen-lake episodes (up to ``--max-turns`` turns,
   ``--max-tokens-per-step`` new tokens a turn) with the real ``Sampler`` and the cached
   tiny model, and turns every turn into a step-wise sample (``data.samples.step_samples``,
   one random advantage per trajectory).
2. Lays the samples out two ways, both ``[n_micro, row_len]`` with segment ids: packed
   (``PackingConfig.pack``: first-fit-decreasing into rows of ``--micro-batch-max-tokens``,
   default the sequence length; samples moved to a 128-token block edge where that is free
   and saves attention block pairs, as ``PackingConfig.align_when_free`` does) and padded
   (``pad_samples``: one sample per row, row length = the longest sample). Row counts are
   exact (``rows_bucket=1``) so the figures measure the layouts, not the row bucketing;
   ``*_pow2_buckets`` gives the efficiencies under the packers' default power-of-two
   buckets, ``packed_efficiency_learner_step`` the ``tokens/efficiency`` of
   ``Learner.step`` (mini-batches of ``--mini-batch-size`` packed to one shared row count
   with the run's ``PackingConfig`` defaults; row groups holding only padding are not
   computed). ``*_efficiency`` cover the whole rollout.
3. Times one optimizer update (forward + backward + AdamW over all micro-batch rows: the
   learner's own jitted ``engine.update_step``) on one random mini-batch of ``--mini-batch-size``
   samples in each layout (``timed_*``), and in a third, the packed rows with their
   samples back to back (``tight_*``: ``align_when_free`` off): one warm-up call per layout
   (compiles; reported as ``*_first_call_s``), then ``--repeats`` timed calls interleaved
   (packed, padded, tight, packed, ...) so all see the same load on shared cores; the
   median.

    efficiency   = real tokens / computed slots (rows × row_len)
    tokens_per_s = real tokens of the mini-batch / median step time

Attention is segment-aware (``pallas_kernels.segment_attention``): both layouts compute only
the 128-token block pairs their segments need (``timed_*_block_pairs_computed_causal``), so
its work follows Σ len² of the samples in either layout. What packing removes is padding
slots: ``timed_slot_ratio`` = padded / packed slots the update computes
(``per_token.computed_slots``), the speedup if every slot cost the same and nothing else
differed. Since the attention's work does not shrink with the slots, the step's speedup
stays below that ratio by the attention's share of the step; ``--ablate-attention``
measures the rest alone (each layer's attention replaced by its queries: not a model, an
ablation; XLA then also prunes the unused k and v projections). ``--with-ablation`` times
that ablated update beside the real one, interleaved in the same run:
``speedup_attention_ablated`` is about the speedup packing would reach if attention cost
nothing, a ceiling no attention kernel can raise, and ``*_attention_s`` the attention's
share of each layout's step (full minus ablated). ``timed_sorted_padded_efficiency``: the
slot efficiency of the padded layout a careful padded trainer uses instead of one sample per
row (samples sorted by length, micro-batches of at most the row's tokens, each padded to its
longest; ``baseline_packing.dynamic_batches``), untimed: its micro-batches have a shape per
length.

``--tree`` times tree packing instead (``PackingConfig.share_group_prefix``: each group's
shared first prompt computed once per row, ``data/tree_packing.py``) beside flat packing, on
one mini-batch of whole groups (``split_minibatches(keep_groups=True)``, as a run with
``share_group_prefix`` draws them; the same samples in both layouts): ``tree_speedup`` =
flat / tree median update time, ``computed_token_ratio`` = flat / tree computed slots,
``shared_saved`` the tokens not computed. ``--sample-mode trajectory`` makes one sample per
episode (the default recipe's) instead of one per turn.
Prints ONE JSON line.

    python scripts/bench/bench_packing.py                     # 8 groups × 4 episodes, 5 turns
    python scripts/bench/bench_packing.py --tree --repeats 5
    python scripts/bench/bench_packing.py --micro-batch-max-tokens 2048 --repeats 3
    python scripts/bench/bench_packing.py --micro-batch-max-tokens 2048 --ablate-attention
    python scripts/bench/bench_packing.py --micro-batch-max-tokens 2048 --with-ablation
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import statistics
import sys
import time
from collections.abc import Callable
from typing import Any

import common

os.environ.setdefault("JAX_PLATFORMS", "cpu")

import jax  # noqa: E402
import numpy as np  # noqa: E402
from flax import nnx  # noqa: E402

sys.path.insert(0, common.ROOT)

from jaxrl_agentic.data import (  # noqa: E402
    PackingConfig,
    pack_minibatches,
    split_minibatches,
    token_stats,
)
from jaxrl_agentic.data.baseline_packing import dynamic_batches, pad_samples  # noqa: E402
from jaxrl_agentic.data.samples import step_samples, trajectory_sample  # noqa: E402
from jaxrl_agentic.envs import make  # noqa: E402
from jaxrl_agentic.models import load_pretrained, transformer  # noqa: E402
from jaxrl_agentic.models.tiny import default_tiny_model_dir  # noqa: E402
from jaxrl_agentic.rollout.conversation import ChatFormatter  # noqa: E402
from jaxrl_agentic.rollout.groups import EnvManagerConfig, plan_episodes  # noqa: E402
from jaxrl_agentic.rollout.loop import RolloutRunner  # noqa: E402
from jaxrl_agentic.rollout.turns import GenerationConfig  # noqa: E402
from jaxrl_agentic.runtime.parallel import make_mesh, num_batch_shards  # noqa: E402
from jaxrl_agentic.sampling import Sampler  # noqa: E402
from jaxrl_agentic.training.learner import Learner  # noqa: E402
from jaxrl_agentic.training.learner_config import LearnerConfig  # noqa: E402
from jaxrl_agentic.training.per_token import computed_slots  # noqa: E402
from jaxrl_agentic.training.update import pad_to_shards, put_batch  # noqa: E402
from pallas_kernels import segment_attention  # noqa: E402

ENV = "frozen_lake"


def _parse_args():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--groups", type=int, default=8, help="env groups (distinct maps)")
    parser.add_argument("--group-size", type=int, default=4, help="episodes per group")
    parser.add_argument("--max-turns", type=int, default=5)
    parser.add_argument("--max-tokens-per-step", type=int, default=16)
    parser.add_argument("--attention-block", type=int, default=0,
                        help="tokens per block of segment attention (0: its default BLOCK)")
    parser.add_argument("--max-input-length", type=int, default=1024,
                        help="prompt tokens per turn (the trainer's default)")
    parser.add_argument("--micro-batch-max-tokens", type=int, default=0,
                        help="packed row length (default 0: the sequence length, "
                             "max-input-length + max-tokens-per-step)")
    parser.add_argument("--mini-batch-size", type=int, default=32,
                        help="samples in the timed update (the trainer's default; 0 = all)")
    parser.add_argument("--repeats", type=int, default=5, help="timed updates per layout")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--ablate-attention", action="store_true",
                        help="time the update with each layer's attention output replaced by "
                             "its queries: the per-token work alone (not a model)")
    parser.add_argument("--with-ablation", action="store_true",
                        help="also time the packed and padded updates with attention ablated "
                             "(as --ablate-attention), interleaved with the real ones in this "
                             "run: speedup_attention_ablated, the speedup no attention kernel "
                             "can beat on this mini-batch")
    parser.add_argument("--tree", action="store_true",
                        help="time tree packing (share_group_prefix) beside flat packing")
    parser.add_argument("--sample-mode", choices=("step", "trajectory"), default="step",
                        help="one sample per turn (default) or per episode")
    args = parser.parse_args()
    if args.tree and (args.ablate_attention or args.with_ablation):
        parser.error("--tree times its own two layouts; run the ablations without it")
    if args.ablate_attention and args.with_ablation:
        parser.error("--with-ablation times the ablated update beside the real one; "
                     "--ablate-attention replaces the real one: pick one")
    return args


def _rollout(model, tokenizer, args):
    """Real trajectories of the tiny model on frozen lake, and the wall time it took."""
    env, env_params = make(ENV)
    total = args.max_input_length + args.max_tokens_per_step + 1
    sampler = Sampler(model, tokenizer, max_total_len=-(-total // 64) * 64)
    runner = RolloutRunner(
        env, env_params, sampler, ChatFormatter(tokenizer), tag=ENV,
        max_turns=args.max_turns, max_input_length=args.max_input_length,
        generation=GenerationConfig(max_tokens_per_step=args.max_tokens_per_step),
        run_seed=args.seed,
    )
    manager = EnvManagerConfig(num_env_groups=args.groups, group_size=args.group_size,
                               tags=(ENV,))
    episodes = plan_episodes(manager, split="train")[ENV]
    start = time.perf_counter()
    trajs = runner.run(episodes, sample_seed=args.seed)
    return trajs, time.perf_counter() - start


def _samples(trajs, seed, mode="step"):
    """Step-wise (or trajectory) samples; one standard-normal advantage per trajectory
    (GRPO-like scale)."""
    rng = np.random.default_rng(seed)
    if mode == "trajectory":
        samples = [trajectory_sample(t, float(rng.normal())) for t in trajs]
        return [s for s in samples if s is not None]  # None: the model never generated
    return [s for t in trajs for s in step_samples(t, float(rng.normal()))]


@dataclasses.dataclass
class _Run:
    """One learner's jitted update, its current state and the batches it is timed on."""

    step: Callable
    state: Any
    batches: list
    lr: np.float32


def _call(run: _Run, batch):
    """Seconds of one update of ``run`` on ``batch``; the state is donated by the step, so
    the new one replaces it in ``run``."""
    start = time.perf_counter()
    run.state, metrics = run.step(run.state, batch, run.lr)
    jax.block_until_ready((run.state, metrics))
    if int(metrics["nonfinite"]):
        raise RuntimeError("the train step skipped a non-finite update")
    return time.perf_counter() - start


def _warm_up(run):
    """First-call seconds per batch of ``run`` (each call traces and compiles)."""
    return [_call(run, batch) for batch in run.batches]


def _time_interleaved(runs, repeats):
    """Median seconds per batch of each (warmed-up) run: ``repeats`` rounds, each timing
    every batch of every run once, so all see the same load on shared cores."""
    times = [[[] for _ in run.batches] for run in runs]
    for _ in range(repeats):
        for run, buckets in zip(runs, times, strict=True):
            for batch, bucket in zip(run.batches, buckets, strict=True):
                bucket.append(_call(run, batch))
    return [[statistics.median(t) for t in buckets] for buckets in times]


def _update_run(model, placed, packing, mesh) -> _Run:
    """A fresh learner's update on the ``placed`` layouts (traced at its first call: an
    ablation patched in before then applies to it alone)."""
    graphdef, params = nnx.split(model)
    config = LearnerConfig(learning_rate=1e-6, packing=packing)
    learner = Learner(graphdef, params, config, mesh)
    engine = learner.engine
    batches = [put_batch(layout, engine.batch_keys, mesh) for layout in placed]
    return _Run(engine.update_step, learner.state, batches, np.float32(config.learning_rate))


def _layouts(samples, micro_batch_max_tokens, sequence_length, *, pow2_buckets=False,
             align_when_free=True):
    """(packed, padded) batches of the same samples. Exact row counts and a padded row as
    long as the longest sample; with ``pow2_buckets`` the packers' defaults instead (row
    counts and padded row length rounded up to powers of two, the latter capped at
    ``sequence_length``). Packed samples start on an attention block edge where that is
    free and saves block pairs, as ``PackingConfig.align_when_free`` lays them out
    (``align_when_free=False``: back to back)."""
    exact = {} if pow2_buckets else {"rows_bucket": 1}
    packed = PackingConfig(micro_batch_max_tokens=micro_batch_max_tokens,
                           sequence_length=sequence_length, align_when_free=align_when_free,
                           rows_bucket=0 if pow2_buckets else 1).pack(samples)
    padded = pad_samples(samples, sequence_length=sequence_length,
                         **({} if pow2_buckets else {"length_bucket": 1}), **exact)
    return packed, padded


def _sorted_padded_efficiency(samples, row_len, sequence_length):
    """Real tokens / slots of the padded layout a padded trainer would pick instead:
    samples sorted by length, micro-batches of at most ``row_len`` padded slots, each padded
    to its longest sample (``dynamic_batches``, exact lengths and row counts)."""
    batches = dynamic_batches(samples, row_len, sequence_length=sequence_length,
                              length_bucket=1, rows_bucket=1)
    slots = sum(b.num_micro_batches * b.row_len for b in batches)
    return sum(len(s) for s in samples) / slots


def _trainer_efficiency(samples, mini_batch_size, packing, mesh, seed):
    """``tokens/efficiency`` as ``Learner.step`` reports it: shuffled mini-batches packed to
    one shared row count (``packing``: the run's defaults, ``fixed_rows`` on), real tokens
    over the slots the update computes (row groups of padding only are skipped)."""
    minibatches = split_minibatches(samples, mini_batch_size, 1, np.random.default_rng(seed))
    packed = pack_minibatches(minibatches, packing, mini_batch_size=mini_batch_size,
                              rows_multiple=num_batch_shards(mesh))
    real = sum(token_stats(b)["real_tokens"] for b in packed)
    return real / sum(computed_slots(b, mesh, packing.row_prefixes) for b in packed)


def _attention_block_pairs(batch):
    """(block pairs segment attention computes, block pairs of the causal triangle) over all
    rows of `batch` (`pallas_kernels.segment_attention.attended_block_pairs`)."""
    ids = batch.token_arrays()["segment_ids"].reshape(-1, batch.row_len)
    return segment_attention.attended_block_pairs(ids)


def _ablate_attention():
    """Every layer's attention output replaced by its queries (same shape, a gradient that
    reaches q_proj): what the update costs without the attention's work."""
    transformer.segment_attention = lambda q, k, v, segment_ids, impl=None: q * 1.0


def _tree_comparison(args, model, samples, row_len, sequence_length, load_before, rollout_s):
    """Flat vs tree packing of one mini-batch of whole groups, timed side by side."""
    mesh = make_mesh()
    size = args.mini_batch_size or len(samples)
    minibatch = split_minibatches(samples, size, 1, np.random.default_rng(args.seed),
                                  keep_groups=True)[0]
    names = ("flat", "tree")
    configs = [PackingConfig(micro_batch_max_tokens=row_len, sequence_length=sequence_length,
                             rows_bucket=1, share_group_prefix=name == "tree")
               for name in names]
    layouts = [pad_to_shards(c.pack(minibatch), mesh, c.pad_token_id) for c in configs]
    slots = [computed_slots(b, mesh, c.row_prefixes) for b, c in zip(layouts, configs,
                                                                      strict=True)]
    runs = [_update_run(model, [b], c, mesh) for b, c in zip(layouts, configs, strict=True)]
    first = [_warm_up(run)[0] for run in runs]
    (flat_s,), (tree_s,) = _time_interleaved(runs, args.repeats)
    stats = [token_stats(b) for b in layouts]
    pairs = [segment_attention.attended_block_pairs(b.segment_ids, prefix_ids=b.prefix_ids)
             for b in layouts]
    print(json.dumps({
        "backend": jax.default_backend(), "env": ENV, "sample_mode": args.sample_mode,
        "num_trajectories": args.groups * args.group_size, "num_samples": len(samples),
        "timed_samples": len(minibatch), "micro_batch_max_tokens": row_len,
        "sample_tokens": int(sum(len(s) for s in minibatch)),
        "shared_saved": int(stats[1]["shared_saved"]),
        "flat_rows": layouts[0].num_micro_batches, "tree_rows": layouts[1].num_micro_batches,
        "flat_computed_slots": slots[0], "tree_computed_slots": slots[1],
        "computed_token_ratio": round(slots[0] / slots[1], 3),
        "real_token_ratio": round(stats[0]["real_tokens"] / stats[1]["real_tokens"], 3),
        "flat_block_pairs_computed_causal": pairs[0],
        "tree_block_pairs_computed_causal": pairs[1],
        "flat_step_s": round(flat_s, 4), "tree_step_s": round(tree_s, 4),
        "tree_speedup": round(flat_s / tree_s, 3),
        "flat_first_call_s": round(first[0], 2), "tree_first_call_s": round(first[1], 2),
        "rollout_s": round(rollout_s, 2),
        "loadavg_1m": [round(load_before, 2), round(os.getloadavg()[0], 2)],
        "timing": (f"one update_step (fwd+bwd over all rows + AdamW) on one mini-batch of "
                   f"{len(minibatch)} samples already on device; median of {args.repeats} "
                   f"interleaved runs after 1 warm-up (compile) per layout"),
    }))


def main():
    args = _parse_args()
    if args.attention_block:
        segment_attention.BLOCK = args.attention_block
    load_before = os.getloadavg()[0]
    sequence_length = args.max_input_length + args.max_tokens_per_step
    row_len = args.micro_batch_max_tokens or sequence_length
    model, tokenizer = load_pretrained(default_tiny_model_dir())
    trajs, rollout_s = _rollout(model, tokenizer, args)
    samples = _samples(trajs, args.seed, args.sample_mode)
    lengths = np.array([len(s) for s in samples])
    if args.tree:
        _tree_comparison(args, model, samples, row_len, sequence_length, load_before,
                         rollout_s)
        return

    # The whole rollout laid out at once: the efficiency figures.
    packed, padded = _layouts(samples, row_len, sequence_length)
    packed_stats, padded_stats = token_stats(packed), token_stats(padded)
    assert packed_stats["real_tokens"] == padded_stats["real_tokens"] == lengths.sum()
    pow2_packed, pow2_padded = (
        token_stats(b) for b in _layouts(samples, row_len, sequence_length,
                                         pow2_buckets=True))

    size = args.mini_batch_size or len(samples)
    packing = PackingConfig(micro_batch_max_tokens=row_len, sequence_length=sequence_length)
    mesh = make_mesh()
    trainer_eff = _trainer_efficiency(samples, size, packing, mesh, args.seed)

    # One mini-batch (a random subset, as the trainer draws them): the timed update.
    order = np.random.default_rng(args.seed).permutation(len(samples))
    minibatch = [samples[i] for i in order[:size]]
    # packed, padded, and packed back to back (align_when_free off): timed side by side.
    timed = (*_layouts(minibatch, row_len, sequence_length),
             _layouts(minibatch, row_len, sequence_length, align_when_free=False)[0])
    timed_stats = [token_stats(b) for b in timed]

    placed = [pad_to_shards(layout, mesh, packing.pad_token_id) for layout in timed]
    slots = [computed_slots(layout, mesh, packing.row_prefixes) for layout in placed]
    if args.ablate_attention:  # after the rollout, which needs the real model
        _ablate_attention()
    runs = [_update_run(model, placed, packing, mesh)]
    first_s = _warm_up(runs[0])
    if args.with_ablation:
        # The real update is traced by its warm-up above, before the patch; the ablated
        # learner is traced after it, so one process times both side by side.
        _ablate_attention()
        runs.append(_update_run(model, placed[:2], packing, mesh))
        _warm_up(runs[1])
    medians = _time_interleaved(runs, args.repeats)
    packed_s, padded_s, tight_s = medians[0]
    ablated = {}
    if args.with_ablation:
        ablated_packed_s, ablated_padded_s = medians[1]
        ablated = {
            "ablated_packed_step_s": round(ablated_packed_s, 4),
            "ablated_padded_step_s": round(ablated_padded_s, 4),
            "speedup_attention_ablated": round(ablated_padded_s / ablated_packed_s, 3),
            "packed_attention_s": round(packed_s - ablated_packed_s, 4),
            "padded_attention_s": round(padded_s - ablated_padded_s, 4),
        }

    real = timed_stats[0]["real_tokens"]
    print(json.dumps({
        "backend": jax.default_backend(),
        "env": ENV,
        "num_trajectories": len(trajs),
        "num_samples": len(samples),
        "sample_len_min_median_max": [int(lengths.min()), int(np.median(lengths)),
                                      int(lengths.max())],
        "real_tokens": int(packed_stats["real_tokens"]),
        "micro_batch_max_tokens": row_len,
        "sequence_length": sequence_length,
        "packed_rows": packed.num_micro_batches,
        "padded_rows": padded.num_micro_batches,
        "padded_row_len": padded.row_len,
        "packed_efficiency": round(packed_stats["efficiency"], 4),
        "padded_efficiency": round(padded_stats["efficiency"], 4),
        "packed_efficiency_pow2_buckets": round(pow2_packed["efficiency"], 4),
        "padded_efficiency_pow2_buckets": round(pow2_padded["efficiency"], 4),
        "packed_efficiency_learner_step": round(trainer_eff, 4),
        "timed_samples": len(minibatch),
        "timed_real_tokens": int(real),
        "timed_packed_rows": timed[0].num_micro_batches,
        "timed_padded_rows": timed[1].num_micro_batches,
        "timed_padded_row_len": timed[1].row_len,
        "timed_packed_efficiency": round(timed_stats[0]["efficiency"], 4),
        "timed_padded_efficiency": round(timed_stats[1]["efficiency"], 4),
        "timed_sorted_padded_efficiency": round(
            _sorted_padded_efficiency(minibatch, row_len, sequence_length), 4),
        "timed_packed_computed_slots": slots[0],
        "timed_padded_computed_slots": slots[1],
        "timed_slot_ratio": round(slots[1] / slots[0], 3),
        "attention_ablated": args.ablate_attention,
        "attention_block": segment_attention.BLOCK,
        "timed_packed_block_pairs_computed_causal": _attention_block_pairs(timed[0]),
        "timed_padded_block_pairs_computed_causal": _attention_block_pairs(timed[1]),
        "timed_tight_block_pairs_computed_causal": _attention_block_pairs(timed[2]),
        "packed_step_s": round(packed_s, 4),
        "padded_step_s": round(padded_s, 4),
        "packed_tokens_per_s": round(real / packed_s, 1),
        "padded_tokens_per_s": round(real / padded_s, 1),
        "speedup": round(padded_s / packed_s, 3),
        "tight_step_s": round(tight_s, 4),
        **ablated,
        "speedup_of_align_when_free": round(tight_s / packed_s, 3),
        "packed_first_call_s": round(first_s[0], 2),
        "padded_first_call_s": round(first_s[1], 2),
        "rollout_s": round(rollout_s, 2),
        "model_params": int(sum(x.size for x in jax.tree.leaves(nnx.split(model)[1]))),
        "model": {k: getattr(model.cfg, k) for k in (
            "vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers",
            "num_attention_heads", "num_key_value_heads", "head_dim")},
        "loadavg_1m": [round(load_before, 2), round(os.getloadavg()[0], 2)],
        "timing": (f"one update_step (fwd+bwd over all rows + AdamW) on one mini-batch of "
                   f"{len(minibatch)} samples already on device; median of {args.repeats} "
                   f"interleaved runs after 1 warm-up (compile) per layout"),
    }))


if __name__ == "__main__":
    main()
