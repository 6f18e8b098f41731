"""The memory plan (jaxrl_agentic/runtime/memory_plan.py) of Qwen2.5 0.5B/1.5B/3B/7B on 24/40/80 GB
devices and a TPU v5e-8: per device, the first setting that fits. Prints a markdown table
(for docs/real_models.md) and, last, one JSON line with every figure.

    python scripts/analysis/memory_table.py [--row 4096] [--episodes 128] [--lora-rank 16]

Settings tried, cheapest in compute first: fp32 parameters and AdamW without remat; the
same with remat="layer"; bf16 parameters and moments (fp32 gradients) with remat; then
sharded over the devices with mesh.fsdp (the TPU's 8 chips; on one GPU, no further step).
Every setting keeps the KL reference (init_kl_coef > 0) and the sampler's KV cache for
`--episodes` rows of `--cache` tokens, as the Qwen recipes do. `--lora-rank R`: LoRA of rank
R on every projection (`models/lora.py`): the base frozen (its storage dtype as the setting
says), gradients and AdamW moments for the adapters alone, the base as the KL reference.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))

from jaxrl_agentic.models.config import ModelConfig  # noqa: E402
from jaxrl_agentic.models.lora import LoRAConfig, adapter_count  # noqa: E402
from jaxrl_agentic.runtime.memory_plan import GIB, memory_plan  # noqa: E402

MODELS = {
    "Qwen2.5-0.5B": dict(hidden_size=896, num_hidden_layers=24, num_attention_heads=14,
                         num_key_value_heads=2, intermediate_size=4864, vocab_size=151_936,
                         tie_word_embeddings=True),
    "Qwen2.5-1.5B": dict(hidden_size=1536, num_hidden_layers=28, num_attention_heads=12,
                         num_key_value_heads=2, intermediate_size=8960, vocab_size=151_936,
                         tie_word_embeddings=True),
    "Qwen2.5-3B": dict(hidden_size=2048, num_hidden_layers=36, num_attention_heads=16,
                       num_key_value_heads=2, intermediate_size=11_008, vocab_size=151_936,
                       tie_word_embeddings=True),
    "Qwen2.5-7B": dict(hidden_size=3584, num_hidden_layers=28, num_attention_heads=28,
                       num_key_value_heads=4, intermediate_size=18_944, vocab_size=152_064,
                       tie_word_embeddings=False),
}
# (name, bytes per device, devices that can shard the state)
DEVICES = (("24 GB GPU", 24e9, 1), ("40 GB GPU", 40e9, 1), ("80 GB GPU", 80e9, 1),
           ("TPU v5e-8 (16 GB × 8)", 16e9, 8))


def model_config(name: str, dtype: str, param_dtype: str) -> ModelConfig:
    spec = MODELS[name]
    return ModelConfig(model_type="qwen2", head_dim=spec["hidden_size"]
                       // spec["num_attention_heads"], attention_bias=True, dtype=dtype,
                       param_dtype=param_dtype, **spec)


def settings(devices: int):
    yield "fp32 params, no remat", "float32", "none", 1
    yield "fp32 params, remat=layer", "float32", "layer", 1
    yield "bf16 params, remat=layer", "bfloat16", "layer", 1
    if devices > 1:
        yield f"fp32 params, remat=layer, fsdp={devices}", "float32", "layer", devices
        yield f"bf16 params, remat=layer, fsdp={devices}", "bfloat16", "layer", devices


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--row", type=int, default=4096, help="micro_batch_max_tokens")
    parser.add_argument("--episodes", type=int, default=128, help="sampler rows")
    parser.add_argument("--cache", type=int, default=3200, help="sampler cache length")
    parser.add_argument("--lora-rank", type=int, default=0, help="LoRA rank (0 = full)")
    args = parser.parse_args(argv)
    rows, record = [], {}
    for name in MODELS:
        for device, budget, devices in DEVICES:
            choice = None
            for label, param_dtype, remat, shards in settings(devices):
                cfg = model_config(name, "bfloat16", param_dtype)
                plan = memory_plan(cfg, row_len=args.row, loss_slots=args.row // 4,
                                   remat=remat, kernel_impl="auto", reference=True,
                                   shards=shards, sampler_rows=args.episodes // devices,
                                   sampler_len=args.cache, budget=budget,
                                   lora_params=adapter_count(cfg, LoRAConfig(args.lora_rank)))
                if plan.total <= 0.9 * budget:  # 10% for the runtime and fragmentation
                    choice = (label, plan)
                    break
            if choice is None:
                rows.append(f"| {name} | {device} | does not fit | — |")
                record[f"{name} / {device}"] = None
                continue
            label, plan = choice
            items = dataclasses.asdict(plan)["items"]
            record[f"{name} / {device}"] = {"setting": label, "total_gib": plan.total / GIB,
                                            **{n: b / GIB for n, b in items}}
            rows.append(f"| {name} | {device} | {label} | {plan.total / GIB:.1f} GiB "
                        f"(state {plan.training_state / GIB:.1f}, activations "
                        f"{dict(items)['activations'] / GIB:.1f}) |")
    print("| model | device | first setting that fits | per device |")
    print("|---|---|---|---|")
    print("\n".join(rows))
    print(json.dumps({"row": args.row, "episodes": args.episodes, "cache": args.cache,
                      "lora_rank": args.lora_rank, "plans": record}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
