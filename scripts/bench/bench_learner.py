"""One PPO update (forward + backward + AdamW) of our learner vs a PyTorch reference, CPU or GPU.

Both sides start from the same random-weight Qwen2 checkpoint (written here with
`transformers` + torch, one per `--sizes` entry) and make one optimizer update on the same
samples with the same loss and optimizer:

    r_t  = exp(logp_t − old_t)
    loss = Σ_t m_t · max(−A_t·r_t, −A_t·clip(r_t, 1−ε, 1+ε)) / Σ_t m_t     (token mean)
    g    = clip_by_global_norm(∇loss, 1.0);  θ ← AdamW(θ, g)  (decay 0.01, matrices only)

with ε = 0.2, no KL, no entropy term, one mini-batch = one update. The samples look like
multi-turn rollouts: `--samples` sequences of `--min-len`..`--max-len` random tokens (fixed
seed), a prompt, then generated chunks (8–32 tokens, loss mask 1) alternating with
observations (30–100 tokens, mask 0); one N(0, 1) advantage per sample; old logprobs = the
model's own logprobs + N(0, 0.1) noise, so ratios sit around 1 and some tokens clip.

* **Ours**: `jaxrl_agentic.training.learner.Learner` with
  `LearnerConfig(loss_reduction="token_mean", init_kl_coef=0, entropy_loss_coef=0,
  ppo_epochs=1, mini_batch_size=--samples)`, packing as the trainer's defaults do
  (`fixed_rows`, `rows_bucket=4`) into rows of `--row-len`
  tokens (`micro_batch_max_tokens = sequence_length`). The first `Learner.step(samples,
  [lr])` compiles, and the batch it hands to the jitted `learner.engine.update_step` is
  kept: the timed call (`ours_*`) is that `update_step` on that batch, already on the
  device (device work only). `ours_step_*` times the whole `Learner.step` instead:
  shuffling, packing, the host→device copy and the 8-sample logprob mismatch check
  included.
* **Torch** (`transformers`' `Qwen2ForCausalLM`, its default `sdpa` attention, float32,
  `use_cache=False`): `--torch-layout padded` (default) is what a PyTorch user does on CPU:
  samples sorted by length and cut into micro-batches of at most `--torch-micro-tokens`
  padded slots (default 1024: mostly one to three samples, little padding), each padded
  to its own longest sample (2-D attention mask); gradients accumulated, then one
  `clip_grad_norm_` + `torch.optim.AdamW` step. `--torch-layout packed` feeds torch our
  packed rows instead (positions restarting per segment, which `transformers` turns into
  a block-diagonal causal mask). The defaults are torch's fastest of the layouts tried
  (padded ≤ 1024 / 4096 / 8192 slots, packed rows). Log-probs come from `cross_entropy`
  on the full logits. Torch gets as many intra-op threads as XLA's CPU client uses (one
  per core this process may run on).
* `--dtype bfloat16`: both sides compute in bf16 with float32 parameters and optimizer
  state (ours `load_pretrained(dtype="bfloat16", param_dtype="float32")`, torch
  `torch.autocast(bfloat16)` around the forward, logits cast back to float32), as real
  models train on a GPU; the losses then agree to ~1e-3 rather than ~1e-4.
  `--attention-impl` sets our `LearnerConfig.attention_impl` (`cudnn` needs a Hopper GPU
  and bf16).

Both sides count the same real tokens (Σ sample lengths). Each side runs one untimed
warm-up update on identical weights and samples; its loss and gradient norm (before
clipping) are `loss_*` / `grad_norm_*`, which must agree to ~1e-4 (the same computation).
Then `--repeats` rounds of: the matmul below, our `update_step`, torch's update, our
`Learner.step`, so all see the same background load; medians (`round_s` lists every
round). Other jobs on the cores slow torch's OpenMP threads far more than XLA's:
`loadavg_1m` is recorded for that reason.

`--lora-rank R` adds a third update, timed in the same rounds: the same model with LoRA
adapters of rank R on every projection and only they trained (`models/lora.py`), on the
same batch; `lora_vs_full` = median full update time / median LoRA update time.

Machine limit and model FLOP utilisation:

    matmul_flops_per_s = 2·n³ / median time of a jitted fp32 jnp.dot of two n×n matrices
                         (`--matmul-n`, measured in every round; `torch_matmul_flops_per_s`:
                         the same with torch.matmul, whose GEMM library is a bit faster on CPU)
    N                  = Σ_layers (q, k, v, o, gate, up, down weight sizes) + D·V (LM head;
                         the input embedding is a lookup and norms/biases are not counted)
    model_flops        = 6·N·real_tokens + 12·layers·heads·head_dim·Σ_i Lᵢ(Lᵢ+1)/2
                         (matmuls fwd + bwd; causal attention: QKᵀ and PV, 2·head_dim FLOPs
                         per query-key pair each, ×3 for fwd + bwd)
    mfu                = model_flops / update time / matmul_flops_per_s

`*_computed_flops` count what a layout computes: every slot of every computed row through
the matmuls and its full row_len² query-key square (dense masked attention). Ours is an
upper bound: our LM head runs only at each row's `--loss-slots` (a quarter of the row by
default, as the trainer's automatic `micro_batch_max_loss_tokens`); torch's runs at every
slot, as an HF user's cross-entropy over the logits does.
Prints ONE JSON line per size.

`--device gpu` runs both sides on one NVIDIA GPU instead (default `--device cpu`: everything
above, unchanged). JAX gets `JAX_PLATFORMS=cuda` (set before jax is imported, so `--device`
must be spelled out in full) and, unless already set, `XLA_PYTHON_CLIENT_MEM_FRACTION=0.5`
(torch shares the GPU); torch's model, optimizer and every tensor live on `cuda`, and every
timed torch region ends with `torch.cuda.synchronize()` (ours ends with `block_until_ready`
on the new train state and the metrics). fp32 matmuls run as TF32 on both sides, as JAX does
by default on GPU: torch's cuBLAS TF32 switch is turned on (`fp32_matmul_precision` in the
JSON: "tf32" on gpu, "fp32" on cpu), so the losses and gradient norms agree to TF32 precision
(~1e-3) rather than ~1e-4 (our log-prob head still asks for full fp32 products). The
matmul limit uses `--matmul-n 8192` by default there (saturates the GPU); `mfu` stays
relative to that measured matmul, and `mfu_vs_peak` / `torch_mfu_vs_peak` are
model_flops / update time / `--peak-flops` (default 494e12: the H100 SXM datasheet dense
TF32 figure). Torch's `sdpa` picks its CUDA kernel itself (fp32: memory-efficient or math).
`device` / `torch_device` name the device each side ran on (both keys on cpu too).

    python scripts/bench/bench_learner.py                               # tiny and 25m, ~5 min idle
    python scripts/bench/bench_learner.py --sizes tiny --repeats 3      # ~1 min
    python scripts/bench/bench_learner.py --sizes 25m --torch-layout packed
    python scripts/bench/bench_learner.py --device gpu --samples 256    # one NVIDIA GPU
    python scripts/bench/bench_learner.py --cpu-devices 0               # one JAX device per core

`--cpu-devices 0` splits the CPU into one JAX device per core (`mesh.cpu_devices`, as the
default recipe trains): our rows are split over them (the learner's mesh takes every
device), torch keeps its intra-op threads. `jax_devices` in the JSON says which ran.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import statistics
import sys
import tempfile
import time
import types

import common

DEVICE = common.configure(mem_fraction="0.5")  # torch shares the GPU; before jax is imported

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
from flax import nnx  # noqa: E402

sys.path.insert(0, common.ROOT)

from jaxrl_agentic.runtime.parallel import use_cpu_devices  # noqa: E402


def _cpu_devices_flag() -> int:
    """--cpu-devices, read before the imports below start JAX's backend (they do)."""
    early = argparse.ArgumentParser(add_help=False)
    early.add_argument("--cpu-devices", type=int, default=1)
    return early.parse_known_args()[0].cpu_devices


if DEVICE == "cpu":
    use_cpu_devices(_cpu_devices_flag())

from torch_ppo_update import CLIP, MAX_GRAD_NORM, WEIGHT_DECAY, prepare_torch  # noqa: E402

from jaxrl_agentic.data import PackingConfig, Sample  # noqa: E402
from jaxrl_agentic.models import load_pretrained, lora  # noqa: E402
from jaxrl_agentic.run_config import auto_loss_slots  # noqa: E402
from jaxrl_agentic.training.learner import Learner  # noqa: E402
from jaxrl_agentic.training.learner_config import LearnerConfig  # noqa: E402
from jaxrl_agentic.training.per_token import computed_slots  # noqa: E402

# Qwen2-architecture configs (tied embeddings, q/k/v biases, as the tiny default model).
SIZES = {
    "tiny": dict(hidden_size=128, num_hidden_layers=4, num_attention_heads=4,
                 num_key_value_heads=2, intermediate_size=384, vocab_size=576),
    "25m": dict(hidden_size=512, num_hidden_layers=8, num_attention_heads=8,
                num_key_value_heads=2, intermediate_size=1408, vocab_size=8192),
    # Qwen2.5-0.5B's width and vocabulary (hidden 896, 14/2 heads, 4864, 151,936) at 4 of
    # its 24 layers (both sides' fp32 state and torch's full logits fit 24 GB) and at 24.
    "qwen0.5b-4l": dict(hidden_size=896, num_hidden_layers=4, num_attention_heads=14,
                        num_key_value_heads=2, intermediate_size=4864, vocab_size=151_936),
    "qwen0.5b": dict(hidden_size=896, num_hidden_layers=24, num_attention_heads=14,
                     num_key_value_heads=2, intermediate_size=4864, vocab_size=151_936),
    # SmolLM2-135M-Instruct's shape (hidden 576, 30 layers, 9/3 heads of 64, 1536, 49,152),
    # as a Qwen2 (its q/k/v biases are 1,152 values a layer that the Llama lacks).
    "smollm2": dict(hidden_size=576, num_hidden_layers=30, num_attention_heads=9,
                    num_key_value_heads=3, intermediate_size=1536, vocab_size=49_152),
}
TOKEN_KEYS = ("tokens", "positions", "segment_ids", "loss_mask", "advantages", "old_logprobs")


def _parse_args():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--sizes", default="tiny,25m", help=f"comma list of {sorted(SIZES)}")
    parser.add_argument("--samples", type=int, default=32, help="samples in the mini-batch")
    parser.add_argument("--min-len", type=int, default=100)
    parser.add_argument("--max-len", type=int, default=700)
    parser.add_argument("--row-len", type=int, default=1024,
                        help="our packed row length: micro_batch_max_tokens = sequence_length")
    parser.add_argument("--loss-slots", type=int, default=None,
                        help="PackingConfig.loss_slots: the LM head's positions per row "
                             "(default: a quarter of the row, the trainer's automatic "
                             "micro_batch_max_loss_tokens; 0 = every slot)")
    parser.add_argument("--rows-bucket", type=int, default=4,
                        help="PackingConfig.rows_bucket (the trainer's default: 4)")
    parser.add_argument("--no-fixed-rows", action="store_true",
                        help="PackingConfig.fixed_rows=False (the trainer's default is True)")
    parser.add_argument("--row-prefixes", type=int, default=PackingConfig.row_prefixes,
                        help="PackingConfig.row_prefixes: halvings a row group may be cut "
                             "to (the trainer's default: 2; 0 = always the whole row)")
    parser.add_argument("--torch-layout", choices=("padded", "packed"), default="padded")
    parser.add_argument("--torch-micro-tokens", type=int, default=1024,
                        help="torch micro-batch: at most this many (padded) token slots")
    parser.add_argument("--dtype", choices=("float32", "bfloat16"), default="float32",
                        help="compute dtype of both sides; parameters and AdamW stay float32 "
                             "(ours: load_pretrained(dtype, param_dtype='float32'); torch: "
                             "autocast). bfloat16 is how real models train on a GPU")
    parser.add_argument("--attention-impl", default="auto",
                        help="our LearnerConfig.attention_impl (e.g. cudnn on a Hopper GPU "
                             "in bfloat16)")
    parser.add_argument("--lr", type=float, default=1e-5)
    parser.add_argument("--repeats", type=int, default=3, help="timed rounds")
    parser.add_argument("--matmul-n", type=int, default=None,
                        help="n of the n×n fp32 matmul limit (default: 2048 on cpu, 8192 on gpu)")
    parser.add_argument("--skip-torch", action="store_true", help="time ours only")
    parser.add_argument("--lora-rank", type=int, default=0,
                        help="also time a LoRA update of this rank (adapters on every "
                             "projection, base frozen) beside the full one: lora_vs_full")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--cpu-devices", type=int, default=1,
                        help="cpu only: JAX devices the CPU is split into (mesh.cpu_devices; "
                             "0 = one per core): our rows are split over them, torch keeps "
                             "its intra-op threads (default 1)")
    parser.add_argument("--device", choices=("cpu", "gpu"), default="cpu",
                        help="cpu (default), or gpu: JAX on cuda, torch on cuda, TF32 matmuls "
                             "on both sides (read before jax is imported: spell it out)")
    parser.add_argument("--peak-flops", type=float, default=494e12,
                        help="gpu only: the peak for mfu_vs_peak, in FLOP/s (default 494e12: "
                             "the NVIDIA H100 SXM datasheet dense TF32 figure, no sparsity)")
    args = parser.parse_args()
    common.check_flag(parser, args.device, DEVICE)
    if args.max_len > args.row_len:
        parser.error("--max-len must not exceed --row-len (samples would be truncated)")
    if args.loss_slots is None:  # the trainer's automatic micro_batch_max_loss_tokens
        args.loss_slots = auto_loss_slots(args.row_len)
    if args.matmul_n is None:
        args.matmul_n = 8192 if args.device == "gpu" else 2048
    return args


# ----------------------------------------------------------------------------- device


# ----------------------------------------------------------------------------- inputs


def _loss_mask(length: int, rng: np.random.Generator) -> tuple[int, np.ndarray]:
    """(prompt_len, loss_mask) of a multi-turn-like sample: a prompt, then generated chunks
    (8–32 tokens, mask 1) alternating with observations (30–100 tokens, mask 0)."""
    prompt_len = int(rng.integers(40, max(41, length // 3)))
    mask = np.zeros(length, np.float32)
    t, generating = prompt_len, True
    while t < length:
        chunk = int(rng.integers(8, 33) if generating else rng.integers(30, 101))
        if generating:
            mask[t:t + chunk] = 1.0
        t, generating = t + chunk, not generating
    return prompt_len, mask


def _make_samples(args, vocab: int) -> list[Sample]:
    """Samples with zero old logprobs (filled in by `_with_old_logprobs`)."""
    rng = np.random.default_rng(args.seed)
    samples = []
    for i in range(args.samples):
        length = int(rng.integers(args.min_len, args.max_len + 1))
        prompt_len, mask = _loss_mask(length, rng)
        samples.append(Sample(
            tokens=rng.integers(0, vocab, length), loss_mask=mask,
            old_logprobs=np.zeros(length, np.float32),
            advantages=np.float32(rng.normal()) * mask, traj_id=i, prompt_len=prompt_len))
    return samples


def _with_old_logprobs(samples, path, seed):
    """Old logprobs = the model's own logprobs of the generated tokens (`transformers`, one
    sample at a time) + N(0, 0.1) noise."""
    import torch
    import transformers

    device = common.torch_device(DEVICE)
    model = transformers.AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)
    model = model.to(device).eval()
    rng = np.random.default_rng(seed + 1)
    out = []
    with torch.no_grad():
        for s in samples:
            ids = torch.from_numpy(s.tokens.astype(np.int64))[None].to(device)
            logits = model(input_ids=ids, use_cache=False).logits[0, :-1]
            logp = -torch.nn.functional.cross_entropy(logits, ids[0, 1:], reduction="none")
            old = np.zeros(len(s), np.float32)
            old[1:] = logp.cpu().numpy() + rng.normal(0.0, 0.1, len(s) - 1)
            out.append(dataclasses.replace(s, old_logprobs=np.where(s.loss_mask > 0, old, 0.0)))
    return out


# ----------------------------------------------------------------------------- ours


def _learner_config(args) -> LearnerConfig:
    return LearnerConfig(
        learning_rate=args.lr, weight_decay=WEIGHT_DECAY, max_grad_norm=MAX_GRAD_NORM,
        mini_batch_size=args.samples, ppo_epochs=1, loss_reduction="token_mean",
        pg_clip=CLIP, init_kl_coef=0.0, entropy_loss_coef=0.0,
        attention_impl=args.attention_impl,
        packing=PackingConfig(micro_batch_max_tokens=args.row_len, sequence_length=args.row_len,
                              rows_bucket=args.rows_bucket, fixed_rows=not args.no_fixed_rows,
                              loss_slots=args.loss_slots, row_prefixes=args.row_prefixes),
        seed=args.seed)


def _prepare_ours(path, samples, args, lora_rank: int = 0):
    """Runs the first `Learner.step` (compiles) and keeps the batch it gave the engine's
    jitted `update_step`. `lora_rank` > 0: the same model with LoRA adapters of that rank
    on every projection, only they trained (`models/lora.py`).

    Returns (device-step closure, Learner.step closure, learner, packed numpy arrays,
    first-step metrics, first-step seconds)."""
    model, _ = load_pretrained(path, dtype=args.dtype, param_dtype="float32")
    if lora_rank:
        lora.add_lora(model, lora.LoRAConfig(rank=lora_rank), seed=args.seed)
        graphdef, params, frozen = lora.split_trainable(model)
    else:
        (graphdef, params), frozen = nnx.split(model), None
    learner = Learner(graphdef, params, _learner_config(args), frozen=frozen)
    engine = learner.engine
    update_step, captured = engine.update_step, []

    def recording_step(state, batch, lr, *frozen):
        captured.append(batch)
        return update_step(state, batch, lr, *frozen)

    engine.update_step = recording_step  # this instance only, for the first step
    start = time.perf_counter()
    first = learner.step(samples, [args.lr])
    first_s = time.perf_counter() - start
    engine.update_step = update_step
    (batch,) = captured
    lr = np.float32(args.lr)

    def device_step():
        frozen = () if engine.frozen is None else (engine.frozen,)
        learner.state, metrics = update_step(learner.state, batch, lr, *frozen)
        if DEVICE == "gpu":
            jax.block_until_ready(learner.state)  # every output of the step, not just metrics
        if int(metrics["nonfinite"]):  # waits for the update
            raise RuntimeError("our train step skipped a non-finite update")

    def full_step():
        metrics = learner.step(samples, [args.lr])  # host floats: synced already
        if DEVICE == "gpu":
            jax.block_until_ready(learner.state)
        if metrics["optim/nonfinite_updates"]:
            raise RuntimeError("Learner.step skipped a non-finite update")

    packed = {k: np.asarray(batch[k]) for k in TOKEN_KEYS}
    return device_step, full_step, learner, packed, first, first_s


# ----------------------------------------------------------------------------- figures


def make_matmul(n: int):
    """A jitted fp32 n×n @ n×n jnp.dot and its operands, compiled."""
    rng = np.random.default_rng(0)
    a, b = (jnp.asarray(rng.standard_normal((n, n), np.float32)) for _ in range(2))
    dot = jax.jit(jnp.dot)
    dot(a, b).block_until_ready()
    return dot, a, b


def matmul_flops_per_s(n: int, matmul, repeats: int = 5) -> float:
    """Achievable fp32 matmul FLOP/s: 2n³ / median time of the jitted n×n @ n×n jnp.dot."""
    dot, a, b = matmul
    times = [_seconds(lambda: dot(a, b).block_until_ready()) for _ in range(repeats)]
    return 2 * n**3 / statistics.median(times)


def make_torch_matmul(n: int):
    """Torch's fp32 n×n @ n×n (its own GEMM library): a second reference for the limit. On
    gpu the closure ends with `torch.cuda.synchronize()` (it times the GEMM, not its launch)."""
    import torch

    rng = np.random.default_rng(0)
    device = common.torch_device(DEVICE)
    a, b = (torch.from_numpy(rng.standard_normal((n, n), np.float32)).to(device)
            for _ in range(2))

    def matmul():
        out = torch.matmul(a, b)
        common.torch_sync(DEVICE)
        return out

    matmul()
    return matmul


def torch_matmul_flops_per_s(n: int, matmul, repeats: int = 5) -> float:
    """2n³ / median time of torch's n×n @ n×n."""
    times = [_seconds(matmul) for _ in range(repeats)]
    return 2 * n**3 / statistics.median(times)


def _matmul_params(cfg) -> int:
    """N: weights applied as matmuls to every token (LM head included, embedding lookup and
    norms/biases not)."""
    d, h = cfg.hidden_size, cfg.head_dim
    q, kv = cfg.num_attention_heads * h, cfg.num_key_value_heads * h
    per_layer = d * q + 2 * d * kv + q * d + 3 * d * cfg.intermediate_size
    return cfg.num_hidden_layers * per_layer + d * cfg.vocab_size


def _attention_flops(cfg, query_key_pairs: float) -> float:
    """fwd + bwd FLOPs of QKᵀ and PV over `query_key_pairs` pairs, all layers and heads."""
    return 12.0 * cfg.num_hidden_layers * cfg.num_attention_heads * cfg.head_dim * query_key_pairs


def _layout_flops(cfg, n_matmul: int, rows: int, row_len: int) -> float:
    """FLOPs of `rows` dense rows of `row_len` slots (full row_len² attention square)."""
    return 6.0 * n_matmul * rows * row_len + _attention_flops(cfg, rows * row_len**2)


def _seconds(fn) -> float:
    start = time.perf_counter()
    fn()
    return time.perf_counter() - start


def _version(name: str) -> str:
    try:
        return __import__(name).__version__
    except ImportError:
        return "missing"


# ----------------------------------------------------------------------------- main


def bench_size(size, args, threads, matmul, device_keys):
    import torch

    load_before = os.getloadavg()[0]
    torch.set_num_threads(threads)
    with tempfile.TemporaryDirectory(prefix="bench_learner_") as path:
        common.write_random_qwen2(path, args.seed, **SIZES[size],
                                  max_position_embeddings=4096, tie_word_embeddings=True,
                                  rms_norm_eps=1e-6)
        samples = _with_old_logprobs(_make_samples(args, SIZES[size]["vocab_size"]), path,
                                     args.seed)
        # Warm-up update per side, on identical initial weights (ours compiles here).
        device_step, full_step, learner, packed, first, ours_first_s = _prepare_ours(
            path, samples, args)
        lora_step = lora_learner = None
        if args.lora_rank:
            lora_step, _, lora_learner, _, lora_first, _ = _prepare_ours(
                path, samples, args, lora_rank=args.lora_rank)
        cfg = nnx.merge(learner.graphdef, learner.state.params).cfg
        torch_update = ref = micro = torch_first_s = None
        loss_torch = grad_norm_torch = None
        if not args.skip_torch:
            torch_update, ref, micro = prepare_torch(path, samples, packed, args, DEVICE)
            start = time.perf_counter()
            loss_torch, grad_norm_torch = torch_update()
            torch_first_s = time.perf_counter() - start

    times = {"matmul": [], "torch_matmul": [], "ours": [], "torch": [], "step": [], "lora": []}
    torch_matmul = make_torch_matmul(args.matmul_n)
    for _ in range(args.repeats):
        times["matmul"].append(matmul_flops_per_s(args.matmul_n, matmul))
        times["torch_matmul"].append(torch_matmul_flops_per_s(args.matmul_n, torch_matmul))
        times["ours"].append(_seconds(device_step))
        if lora_step is not None:
            times["lora"].append(_seconds(lora_step))
        if torch_update is not None:
            times["torch"].append(_seconds(torch_update))
        times["step"].append(_seconds(full_step))
    median = {k: statistics.median(v) if v else None for k, v in times.items()}
    peak = median["matmul"]

    lengths = np.array([len(s) for s in samples])
    real = int(lengths.sum())
    rows, row_len = packed["tokens"].shape
    busy_rows = int((packed["segment_ids"] > 0).any(axis=1).sum())  # padding rows: skipped
    assert int((packed["segment_ids"] > 0).sum()) == real
    n_matmul = _matmul_params(cfg)
    model_flops = 6.0 * n_matmul * real + _attention_flops(
        cfg, float((lengths * (lengths + 1) // 2).sum()))

    def rate(key):
        return None if median[key] is None else real / median[key]

    def mfu(key, limit=peak, digits=4):
        return None if median[key] is None else round(model_flops / median[key] / limit, digits)

    def r(x, digits=1):
        return None if x is None else round(x, digits)

    ours_tps, torch_tps = rate("ours"), rate("torch")
    lora_keys = {} if lora_step is None else {
        "lora_rank": args.lora_rank,
        "lora_s": r(median["lora"], 3),
        "lora_tokens_per_s": r(rate("lora")),
        "lora_vs_full": round(median["ours"] / median["lora"], 2),
        "lora_trained_params": int(sum(x.size for x in jax.tree.leaves(
            lora_learner.state.params))),
        "lora_first_loss": lora_first["actor/loss"],
    }
    torch_layout = None
    if micro is not None:
        shapes = [tuple(m["model_kwargs"]["input_ids"].shape) for m in micro]
        slots = sum(b * t for b, t in shapes)
        torch_layout = {
            "layout": args.torch_layout,
            "rule": ("samples sorted by length, micro-batches of <= torch_micro_tokens padded "
                     "slots, each padded to its longest sample; 2-D attention mask"
                     if args.torch_layout == "padded" else
                     "our packed rows, torch_micro_tokens // row_len rows per micro-batch; "
                     "block-diagonal causal mask from position_ids"),
            "micro_batches": len(micro), "micro_tokens": args.torch_micro_tokens,
            "slots": slots, "efficiency": round(real / slots, 4),
            "attn": ref.config._attn_implementation}
    gpu_keys = {} if args.device != "gpu" else {
        "mfu_vs_peak": mfu("ours", args.peak_flops, 6),
        "torch_mfu_vs_peak": mfu("torch", args.peak_flops, 6),
        "peak_flops": args.peak_flops,
    }
    return {
        "size": size,
        "ours_tokens_per_s": r(ours_tps),
        "torch_tokens_per_s": r(torch_tps),
        "ratio": None if torch_tps is None else round(ours_tps / torch_tps, 2),
        "mfu": mfu("ours"),
        "torch_mfu": mfu("torch"),
        "ours_step_tokens_per_s": r(rate("step")),
        "ours_s": r(median["ours"], 3),
        "torch_s": r(median["torch"], 3),
        "ours_step_s": r(median["step"], 3),
        "loss_ours": first["actor/loss"],
        "loss_torch": loss_torch,
        "loss_rel_diff": None if loss_torch is None else float(
            f"{abs(first['actor/loss'] - loss_torch) / max(abs(loss_torch), 1e-12):.2e}"),
        "grad_norm_ours": first["actor/grad_norm"],
        "grad_norm_torch": grad_norm_torch,
        "matmul_flops_per_s": round(peak),
        "torch_matmul_flops_per_s": round(median["torch_matmul"]),
        "matmul_n": args.matmul_n,
        "model_flops_per_update": model_flops,
        "flops_formula": "6*N*real_tokens + 12*layers*heads*head_dim*sum_i L_i*(L_i+1)/2, "
                         "N = per-layer q,k,v,o,gate,up,down weights + hidden*vocab (LM head)",
        "ours_computed_flops": _layout_flops(cfg, n_matmul, busy_rows, row_len),
        "torch_computed_flops": None if micro is None else sum(
            _layout_flops(cfg, n_matmul, b, t) for b, t in shapes),
        "real_tokens": real,
        "loss_tokens": int(sum(s.num_loss_tokens for s in samples)),
        "samples": len(samples),
        "sample_len_min_median_max": [int(lengths.min()), int(np.median(lengths)),
                                      int(lengths.max())],
        "ours_layout": {"rows": rows, "computed_rows": busy_rows, "row_len": row_len,
                        "efficiency": round(real / (busy_rows * row_len), 4),
                        "rows_bucket": args.rows_bucket, "fixed_rows": not args.no_fixed_rows,
                        "loss_slots": args.loss_slots, "row_prefixes": args.row_prefixes,
                        # the slots the update computes: each group on its prefix
                        "computed_slots": computed_slots(
                            types.SimpleNamespace(segment_ids=packed["segment_ids"],
                                                  row_len=row_len, num_micro_batches=rows),
                            learner.mesh, args.row_prefixes)},
        "torch_layout": torch_layout,
        "model": {"model_type": cfg.model_type, "hidden": cfg.hidden_size,
                  "layers": cfg.num_hidden_layers, "heads": cfg.num_attention_heads,
                  "kv_heads": cfg.num_key_value_heads, "head_dim": cfg.head_dim,
                  "intermediate": cfg.intermediate_size, "vocab": cfg.vocab_size,
                  "tied": cfg.tie_word_embeddings, "dtype": cfg.dtype,
                  "params": int(sum(x.size for x in jax.tree.leaves(learner.state.params))),
                  "matmul_params": n_matmul},
        "threads": threads,
        "attention_impl": args.attention_impl,
        "jax_devices": len(jax.devices()),
        "loadavg_1m": [round(load_before, 2), round(os.getloadavg()[0], 2)],
        "round_s": {k: [round(t, 3) for t in times[k]]
                    for k in ("ours", "torch", "step", "lora")},
        "round_matmul_gflops": [round(f / 1e9, 1) for f in times["matmul"]],
        "ours_first_call_s": round(ours_first_s, 2),
        "torch_first_call_s": r(torch_first_s, 2),
        "timing": f"median of {args.repeats} rounds (matmuls, ours update_step, torch update, "
                  "ours Learner.step) after 1 warm-up update per side; tokens_per_s = real "
                  "tokens / update time",
        "versions": {"jax": jax.__version__, "transformers": _version("transformers"),
                     "torch": _version("torch")},
        **lora_keys,
        **device_keys,
        **gpu_keys,
    }


def main():
    args = _parse_args()
    sizes = [s.strip() for s in args.sizes.split(",") if s.strip()]
    unknown = [s for s in sizes if s not in SIZES]
    if unknown:
        raise SystemExit(f"unknown --sizes {unknown}; choose from {sorted(SIZES)}")
    device_keys = common.setup(DEVICE)
    threads = len(os.sched_getaffinity(0))  # XLA's CPU client: one intra-op thread per core
    matmul = make_matmul(args.matmul_n)
    for size in sizes:
        print(json.dumps(bench_size(size, args, threads, matmul, device_keys)), flush=True)


if __name__ == "__main__":
    main()
