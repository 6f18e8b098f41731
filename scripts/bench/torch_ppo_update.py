"""The PyTorch side of `bench_learner.py`: one PPO update of `transformers`' model on the
same samples, loss and optimizer as ours (that script's docstring states both sides).

    r_t  = exp(logp_t − old_t)
    loss = Σ_t m_t · max(−A_t·r_t, −A_t·clip(r_t, 1−ε, 1+ε)) / Σ_t m_t     (token mean)
    g    = clip_by_global_norm(∇loss, 1.0);  θ ← AdamW(θ, g)  (decay 0.01, matrices only)

`--torch-layout padded`: samples sorted by length in micro-batches of at most
`--torch-micro-tokens` padded slots; `packed`: our packed rows, positions restarting per
segment. Imports torch only when called.
"""

from __future__ import annotations

import common
import numpy as np

CLIP = 0.2
WEIGHT_DECAY = 0.01
MAX_GRAD_NORM = 1.0




def torch_micro_batches(samples, packed, args, device_name: str):
    """Torch micro-batches: dicts of [b, T] tensors (token-aligned loss_mask, advantages,
    old_logprobs) and the model's keyword arguments."""
    import torch

    device = common.torch_device(device_name)

    def micro_batch(loss_mask, advantages, old_logprobs, **model_kwargs):
        """Every tensor (the model's keyword arguments too) on torch's device."""
        return dict(loss_mask=torch.from_numpy(loss_mask).to(device),
                    advantages=torch.from_numpy(advantages).to(device),
                    old_logprobs=torch.from_numpy(old_logprobs).to(device),
                    model_kwargs={k: v.to(device) for k, v in model_kwargs.items()})

    micro = []
    if args.torch_layout == "packed":
        busy = np.flatnonzero((packed["segment_ids"] > 0).any(axis=1))  # padding rows: none
        per_micro = max(1, args.torch_micro_tokens // packed["tokens"].shape[1])
        for start in range(0, len(busy), per_micro):
            rows = busy[start:start + per_micro]
            seg = packed["segment_ids"][rows]
            # Token t is predicted from t − 1 only inside one segment (as the learner masks).
            same = np.zeros(seg.shape, np.float32)
            same[:, 1:] = (seg[:, 1:] == seg[:, :-1]) & (seg[:, 1:] > 0)
            micro.append(micro_batch(
                packed["loss_mask"][rows] * same, packed["advantages"][rows],
                packed["old_logprobs"][rows],
                input_ids=torch.from_numpy(packed["tokens"][rows].astype(np.int64)),
                position_ids=torch.from_numpy(packed["positions"][rows].astype(np.int64))))
        return micro
    groups, current = [], []
    for i in sorted(range(len(samples)), key=lambda i: -len(samples[i])):
        # Longest first, so a group's first sample sets its padded width.
        if current and len(samples[current[0]]) * (len(current) + 1) > args.torch_micro_tokens:
            groups.append(current)
            current = []
        current.append(i)
    groups.append(current)
    for group in groups:
        width = len(samples[group[0]])
        tokens = np.zeros((len(group), width), np.int64)
        floats = {k: np.zeros((len(group), width), np.float32)
                  for k in ("attention_mask", "loss_mask", "advantages", "old_logprobs")}
        for r, i in enumerate(group):
            s = samples[i]
            tokens[r, :len(s)] = s.tokens
            floats["attention_mask"][r, :len(s)] = 1
            for k in ("loss_mask", "advantages", "old_logprobs"):
                floats[k][r, :len(s)] = getattr(s, k)
        micro.append(micro_batch(
            floats["loss_mask"], floats["advantages"], floats["old_logprobs"],
            input_ids=torch.from_numpy(tokens),
            attention_mask=torch.from_numpy(floats["attention_mask"].astype(np.int64))))
    return micro


def prepare_torch(path, samples, packed, args, device_name: str):
    """(update closure returning (loss, gradient norm) before the update, model,
    micro-batches)."""
    import torch
    import transformers

    model = transformers.AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)
    model = model.to(common.torch_device(device_name))  # before the optimizer sees the parameters
    model.train()
    decay = [p for p in model.parameters() if p.ndim >= 2]
    no_decay = [p for p in model.parameters() if p.ndim < 2]
    optimizer = torch.optim.AdamW(
        [{"params": decay, "weight_decay": WEIGHT_DECAY},
         {"params": no_decay, "weight_decay": 0.0}],
        lr=args.lr, betas=(0.9, 0.999), eps=1e-8)
    micro = torch_micro_batches(samples, packed, args, device_name)
    denominator = float(sum(float(m["loss_mask"][:, 1:].sum()) for m in micro))

    device_type = next(model.parameters()).device.type

    def update():
        losses = []
        for m in micro:
            with torch.autocast(device_type, dtype=torch.bfloat16,
                                enabled=args.dtype == "bfloat16"):
                logits = model(use_cache=False, **m["model_kwargs"]).logits[:, :-1].float()
            targets = m["model_kwargs"]["input_ids"][:, 1:]
            logp = -torch.nn.functional.cross_entropy(
                logits.reshape(-1, logits.shape[-1]), targets.reshape(-1), reduction="none"
            ).view_as(targets)
            adv, mask = m["advantages"][:, 1:], m["loss_mask"][:, 1:]
            ratio = torch.exp(logp - m["old_logprobs"][:, 1:])
            pg = torch.maximum(-adv * ratio, -adv * ratio.clamp(1 - CLIP, 1 + CLIP))
            loss = (pg * mask).sum() / denominator  # one global token-mean denominator
            loss.backward()
            losses.append(loss.detach())  # read after the update: no GPU sync per micro-batch
        grad_norm = torch.nn.utils.clip_grad_norm_(model.parameters(), MAX_GRAD_NORM)
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        total = 0.0
        for loss in losses:
            total += float(loss)
        grad_norm = float(grad_norm)
        common.torch_sync(device_name)
        return total, grad_norm

    return update, model, micro
