"""What the bench scripts share: `--device {cpu,gpu}`, and the random-weight reference model.

**Device.** JAX picks its platform when it is imported, so `--device` is read from the
command line before argparse runs and before jax is imported: a script imports this module,
calls `configure()` (which sets `JAX_PLATFORMS`, and `XLA_PYTHON_CLIENT_MEM_FRACTION` when
asked), then imports jax. `check_flag` makes the script's argparse agree with what was read;
`require_jax_gpu`, `setup`, `torch_device` and `torch_sync` are the GPU checks and torch
helpers `bench_learner`, `bench_sampler` and `bench_pipeline` share.

**Reference model.** `write_random_qwen2` writes the random-weight Hugging Face Qwen2 that
`bench_learner` and `bench_sampler` compare our code and torch on.

This module never imports jax, torch or `jaxrl_agentic` at import time (the functions that
need them import them when called). Run the scripts as `python scripts/bench/<name>.py`:
`scripts/bench/` is then `sys.path[0]` and `import common` works.
"""

from __future__ import annotations

import os
import sys

# The repository root: the scripts put it first on sys.path, so they run without an install.
ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def device_flag(argv: list[str]) -> str:
    """`--device` read before argparse runs (JAX_PLATFORMS must be set before jax is imported;
    the last one wins, as in argparse, which checks it again through `check_flag`)."""
    device = "cpu"
    for i, arg in enumerate(argv):
        if arg == "--":
            break
        if arg == "--device" and i + 1 < len(argv):
            device = argv[i + 1]
        elif arg.startswith("--device="):
            device = arg.split("=", 1)[1]
    return device


def configure(mem_fraction: str | None = None, argv: list[str] | None = None) -> str:
    """Reads `--device` from `argv` (default `sys.argv[1:]`) and sets JAX's environment; call
    before jax is imported. gpu: `JAX_PLATFORMS=cuda` and, if `mem_fraction` is given and the
    variable is not already set, `XLA_PYTHON_CLIENT_MEM_FRACTION=mem_fraction`; otherwise
    `JAX_PLATFORMS` is kept if set, else `cpu`. Returns the device read ("cpu" by default)."""
    device = device_flag(sys.argv[1:] if argv is None else argv)
    if device == "gpu":
        os.environ["JAX_PLATFORMS"] = "cuda"
        if mem_fraction is not None:
            os.environ.setdefault("XLA_PYTHON_CLIENT_MEM_FRACTION", mem_fraction)
    else:
        os.environ.setdefault("JAX_PLATFORMS", "cpu")
    return device


def check_flag(parser, parsed: str, read: str, seen: str = "before jax was imported") -> None:
    """`parser.error` unless argparse's `--device` (`parsed`) is what `configure` read."""
    if parsed != read:
        parser.error(f"--device {parsed} was not seen {seen} (read {read!r}): write it out "
                     f"in full, as --device {parsed}")


def require_jax_gpu(fail=None) -> None:
    """Fails (`fail(message)`, default `SystemExit(message)`) unless JAX runs on a GPU."""
    import jax

    if jax.default_backend() != "gpu":
        message = f"--device gpu: JAX runs on {jax.default_backend()!r}, not a GPU"
        if fail is None:
            raise SystemExit(message)
        fail(message)


def setup(device: str, torch_on_gpu: bool = True) -> dict:
    """Checks the device; on gpu turns on torch's TF32 matmuls (as JAX's default), unless
    `torch_on_gpu` is false (torch then stays on the CPU and is not touched). Returns the
    JSON's device keys: `device`, `torch_device`, `fp32_matmul_precision`."""
    import jax

    kind = jax.devices()[0].device_kind  # initialises JAX's backend before torch loads CUDA
    if device != "gpu":
        return {"device": kind, "torch_device": "cpu", "fp32_matmul_precision": "fp32"}
    require_jax_gpu()
    if not torch_on_gpu:
        return {"device": kind, "torch_device": None, "fp32_matmul_precision": "tf32"}
    import torch

    if not torch.cuda.is_available():
        raise SystemExit("--device gpu: torch sees no CUDA device (a CPU-only torch build?)")
    matmul = torch.backends.cuda.matmul
    if hasattr(matmul, "fp32_precision"):  # torch ≥ 2.9: mixing it with allow_tf32 raises
        matmul.fp32_precision = "tf32"
    else:
        matmul.allow_tf32 = True
    return {"device": kind, "torch_device": torch.cuda.get_device_name(),
            "fp32_matmul_precision": "tf32"}


def torch_device(device: str):
    """Where torch's model and tensors live: `cuda` with --device gpu, else `cpu`."""
    import torch

    return torch.device("cuda" if device == "gpu" else "cpu")


def torch_sync(device: str) -> None:
    """Waits for torch's queued GPU work (ends every timed torch region); no-op on cpu."""
    if device == "gpu":
        import torch

        torch.cuda.synchronize()


def write_random_qwen2(path: str, seed: int, **config) -> None:
    """Random-weight Qwen2 (`transformers.Qwen2Config(**config)`; every tensor perturbed off
    its init by 0.02·N(0, 1) after `torch.manual_seed(seed)`, so no weight is a trivial zero
    or one) + a small BPE tokenizer, into `path`. The same seed and config give the same
    weights."""
    import torch
    import transformers

    from jaxrl_agentic.models.tiny import build_tokenizer

    cfg = transformers.Qwen2Config(**config)
    torch.manual_seed(seed)
    model = transformers.AutoModelForCausalLM.from_config(cfg)
    with torch.no_grad():
        for p in model.parameters():
            p.add_(torch.randn_like(p) * 0.02)
    model.save_pretrained(path)
    build_tokenizer(["a b c d e f g"] * 4, vocab_size=300).save_pretrained(path)
