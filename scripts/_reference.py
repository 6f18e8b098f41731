"""The random-weight reference checkpoint that `bench_learner` and `bench_sampler` compare on.

`write_random_qwen2` writes a Hugging Face Qwen2 directory with `transformers` + torch: every
tensor perturbed off its init (so no weight is a trivial zero or one), plus a small BPE
tokenizer. The same seed and config give the same weights. torch, transformers and
`jaxrl_agentic` are imported when it is called, not at import time. Run the scripts as
`python scripts/<name>.py`: `scripts/` is then `sys.path[0]` and `import _reference` works.
"""

from __future__ import annotations


def write_random_qwen2(path: str, seed: int, **config) -> None:
    """Random-weight Qwen2 (`transformers.Qwen2Config(**config)`; every tensor perturbed
    by 0.02·N(0, 1) after `torch.manual_seed(seed)`) + a small BPE tokenizer, into `path`."""
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
