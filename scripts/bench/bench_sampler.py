"""Decode tokens/s of our `Sampler.generate` vs `transformers` `model.generate`, CPU or GPU.

Both generate from the same random-weight Qwen2 checkpoint (written here with `transformers`
+ torch unless `--model DIR` names an existing HF directory), for the same batch of random
prompts of one length, exactly `--new-tokens` new tokens per row (no EOS can stop a row), by
sampling at temperature 1 with no top-k / top-p (or `--greedy` for argmax in both). Torch
gets as many intra-op threads as XLA's CPU client uses: one per core this process may run
on (so `taskset -c 0 python ...` compares one thread with one thread). Our sampler, as by
default on a CPU, splits the batch into one row block per core, decoded side by side
(`--decode-threads 1`: one program for the whole batch).

    tokens/s             = batch × new_tokens / wall time of one generate call (prefill in)
    decode-only tokens/s = batch × (new_tokens − 1) / (t(new_tokens) − t(1 new token))

Each side runs `--warmup` untimed calls first (our first call compiles; its JAX trace +
lower + compile time is `compile_s`), then `--repeats` timed calls of each kind, alternating
the sides so that both see the same background load, and reports medians. Background load
hurts torch's OpenMP threads far more than XLA's: `loadavg_1m` is recorded for that reason.
Prints ONE JSON line.

`--device gpu` runs both on one NVIDIA GPU instead (default `--device cpu`: everything above,
unchanged). JAX gets `JAX_PLATFORMS=cuda` (set before jax is imported, so `--device` must be
spelled out in full) and, unless already set, `XLA_PYTHON_CLIENT_MEM_FRACTION=0.5` (torch
shares the GPU); `transformers` loads the same weights onto `cuda`, its prompts live there,
and each timed HF call ends with `torch.cuda.synchronize()` (ours ends by fetching the
generated tokens to the host). fp32 matmuls run as TF32 on both sides, as JAX does by default
on GPU: torch's cuBLAS TF32 switch is turned on (`fp32_matmul_precision`: "tf32" on gpu,
"fp32" on cpu). `device` / `torch_device` name the device each side ran on.

    python scripts/bench/bench_sampler.py                          # hidden 256, 4 layers, batch 32
    python scripts/bench/bench_sampler.py --batch 8 --repeats 3    # quicker
    python scripts/bench/bench_sampler.py --model ~/models/Qwen2.5-0.5B --batch 4
    python scripts/bench/bench_sampler.py --device gpu --batch 64  # one NVIDIA GPU
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
import time

import common

DEVICE = common.configure(mem_fraction="0.5")  # torch shares the GPU; before jax is imported

import jax  # noqa: E402
import numpy as np  # noqa: E402

sys.path.insert(0, common.ROOT)

from jaxrl_agentic.models import load_pretrained  # noqa: E402
from jaxrl_agentic.sampling import Sampler  # noqa: E402

_COMPILE_EVENTS = (
    "/jax/core/compile/jaxpr_trace_duration",
    "/jax/core/compile/jaxpr_to_mlir_module_duration",
    "/jax/core/compile/backend_compile_duration",
)


def _parse_args():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default=None,
                        help="existing HF model directory (default: build a random one)")
    parser.add_argument("--hidden", type=int, default=256)
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--heads", type=int, default=8)
    parser.add_argument("--kv-heads", type=int, default=2)
    parser.add_argument("--intermediate", type=int, default=768)
    parser.add_argument("--vocab", type=int, default=2048)
    parser.add_argument("--batch", type=int, default=32)
    parser.add_argument("--prompt-len", type=int, default=64)
    parser.add_argument("--new-tokens", type=int, default=64)
    parser.add_argument("--max-total-len", type=int, default=1024,
                        help="our Sampler's KV-cache length (its default: 1024)")
    parser.add_argument("--decode-threads", type=int, default=None,
                        help="our Sampler's row blocks decoded side by side (default: its "
                             "own, one per core on a CPU)")
    parser.add_argument("--greedy", action="store_true",
                        help="argmax decoding in both (default: sampling at temperature 1)")
    parser.add_argument("--warmup", type=int, default=1, help="untimed calls per side (≥ 1)")
    parser.add_argument("--repeats", type=int, default=5, help="timed calls per side")
    parser.add_argument("--skip-hf", action="store_true", help="time ours only")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--device", choices=("cpu", "gpu"), default="cpu",
                        help="cpu (default), or gpu: JAX on cuda, HF on cuda, TF32 matmuls on "
                             "both sides (read before jax is imported: spell it out)")
    args = parser.parse_args()
    common.check_flag(parser, args.device, DEVICE)
    return args


def _build_checkpoint(args, path: str) -> None:
    """Random-weight Qwen2 of the `--hidden` … `--vocab` shape (see `common.write_random_qwen2`)."""
    common.write_random_qwen2(
        path, args.seed,
        vocab_size=args.vocab,
        hidden_size=args.hidden,
        intermediate_size=args.intermediate,
        num_hidden_layers=args.layers,
        num_attention_heads=args.heads,
        num_key_value_heads=args.kv_heads,
        max_position_embeddings=max(2048, args.max_total_len),
        tie_word_embeddings=True,
    )


def _prepare_ours(path, prompts, args):
    """(generate(new_tokens) closure, config, sampler) for our Sampler on `path`."""
    model, _ = load_pretrained(path)
    sampler = Sampler(model, max_total_len=args.max_total_len, eos_token_id=-1,
                      decode_threads=args.decode_threads)
    lists = prompts.tolist()

    def run(new_tokens):
        out = sampler.generate(lists, max_new_tokens=new_tokens, temperature=1.0,
                               greedy=args.greedy, seed=args.seed)
        assert all(len(t) == new_tokens for t in out.tokens)

    return run, model.cfg, sampler


def _prepare_hf(path, prompts, args, threads):
    """(generate(new_tokens) closure, attention implementation) for `transformers`."""
    import torch
    import transformers

    torch.set_num_threads(threads)  # CPU ops only (harmless on gpu)
    torch.manual_seed(args.seed)  # seeds the CUDA generators too
    device = common.torch_device(DEVICE)
    model = transformers.AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)
    model = model.to(device).eval()
    input_ids = torch.tensor(prompts, dtype=torch.long, device=device)
    kwargs = dict(attention_mask=torch.ones_like(input_ids), eos_token_id=None, pad_token_id=0)
    if args.greedy:
        kwargs.update(do_sample=False)
    else:
        kwargs.update(do_sample=True, temperature=1.0, top_k=0, top_p=1.0)

    def run(new_tokens):
        with torch.no_grad():
            out = model.generate(input_ids, max_new_tokens=new_tokens, min_new_tokens=new_tokens,
                                 **kwargs)
        common.torch_sync(DEVICE)  # the timed call ends when the GPU is done
        assert out.shape == (args.batch, args.prompt_len + new_tokens)

    return run, model.config._attn_implementation


def _seconds(fn, *args) -> float:
    start = time.perf_counter()
    fn(*args)
    return time.perf_counter() - start


def main():
    args = _parse_args()
    # with --skip-hf, torch (if it writes the checkpoint) stays on the CPU
    device_keys = common.setup(DEVICE, torch_on_gpu=not args.skip_hf)
    threads = len(os.sched_getaffinity(0))  # XLA's CPU client: one intra-op thread per core
    compile_s = [0.0]

    def on_event(event, duration, **_):
        if event in _COMPILE_EVENTS:
            compile_s[0] += duration

    load_before = os.getloadavg()[0]
    with tempfile.TemporaryDirectory(prefix="bench_sampler_") as tmp:
        path = args.model or tmp
        if args.model is None:
            _build_checkpoint(args, path)
        with open(os.path.join(path, "config.json")) as f:
            vocab = json.load(f)["vocab_size"]
        prompts = np.random.default_rng(args.seed).integers(0, vocab, (args.batch, args.prompt_len))
        run_ours, cfg, sampler = _prepare_ours(path, prompts, args)
        run_hf, attn = (None, None) if args.skip_hf else _prepare_hf(path, prompts, args, threads)
        jax.monitoring.register_event_duration_secs_listener(on_event)
        first = _seconds(run_ours, args.new_tokens)  # traces and compiles our programs
        first_compile_s = compile_s[0]
        sides = {"ours": run_ours} | ({"hf": run_hf} if run_hf else {})
        for name, run in sides.items():
            for _ in range(args.warmup - (name == "ours")):
                run(args.new_tokens)
            run(1)  # ours: compiles the 1-token decode program
        # Alternate the sides (and full vs 1-token calls) so all see the same background load.
        times = {(name, n): [] for name in sides for n in (args.new_tokens, 1)}
        for _ in range(args.repeats):
            for (name, n), got in times.items():
                got.append(_seconds(sides[name], n))
    median = {key: statistics.median(got) for key, got in times.items()}
    programs = sampler.compilation_count()

    def rates(name):
        """(tokens/s of the whole call, tokens/s of the decode phase alone) for one side."""
        if name not in sides:
            return None, None
        full, one = median[(name, args.new_tokens)], median[(name, 1)]
        decode = args.batch * (args.new_tokens - 1) / max(full - one, 1e-9)
        return args.batch * args.new_tokens / full, decode

    (ours_tps, ours_decode), (hf_tps, hf_decode) = rates("ours"), rates("hf")

    def r(x, digits=1):
        return None if x is None else round(x, digits)

    print(json.dumps({
        "ours_tokens_per_s": r(ours_tps),
        "hf_tokens_per_s": r(hf_tps),
        "ratio": None if hf_tps is None else round(ours_tps / hf_tps, 2),
        "ours_decode_only_tokens_per_s": r(ours_decode),
        "hf_decode_only_tokens_per_s": r(hf_decode),
        "decode_only_ratio": None if hf_decode is None else round(ours_decode / hf_decode, 2),
        "ours_s": r(median[("ours", args.new_tokens)], 4),
        "hf_s": r(median.get(("hf", args.new_tokens)), 4),
        "ours_1_token_s": r(median[("ours", 1)], 4),
        "hf_1_token_s": r(median.get(("hf", 1)), 4),
        "batch": args.batch,
        "prompt_len": args.prompt_len,
        "new_tokens": args.new_tokens,
        "max_total_len": args.max_total_len,
        "decoding": "greedy" if args.greedy else "sample(T=1)",
        "model": {
            "model_type": cfg.model_type, "hidden": cfg.hidden_size,
            "layers": cfg.num_hidden_layers, "heads": cfg.num_attention_heads,
            "kv_heads": cfg.num_key_value_heads, "intermediate": cfg.intermediate_size,
            "vocab": cfg.vocab_size, "dtype": cfg.dtype,
        },
        "threads": threads,
        "decode_threads": sampler.decode_threads,
        # Other processes on these cores slow both sides, torch's OpenMP far more than XLA.
        "loadavg_1m": [round(load_before, 2), round(os.getloadavg()[0], 2)],
        "hf_attn": attn,
        "compile_s": round(first_compile_s, 2),
        "ours_first_call_s": round(first, 2),
        "programs": programs,
        "timing": f"median of {args.repeats} alternating runs after {args.warmup} warm-up; "
                  "tokens_per_s include prefill; decode_only = batch*(new-1) / "
                  "(t(new tokens) - t(1 token))",
        "versions": {"jax": jax.__version__, "transformers": _version("transformers"),
                     "torch": _version("torch")},
        **device_keys,
    }))


def _version(name: str) -> str:
    try:
        return __import__(name).__version__
    except ImportError:
        return "missing"


if __name__ == "__main__":
    main()
