"""Does a generated format token around the decision slow policy-gradient learning?

A contextual bandit through the real `Learner`: the prompt is [BOS, X, six random tokens],
X ∈ {2..5}; the reply follows a pattern of generated tokens, e.g. `oyce` = [OPEN, y, CLOSE,
EOS]; reward 1 iff the format tokens are right and y = X + 4, −1 for a broken format, else 0;
advantages (r − mean)/std over the batch of 64. First a format warm-up (supervised on random
y, as `jaxrl_agentic.warmup` does), then PPO updates on replies sampled from the model.

    python scripts/analysis/probe_reply_format.py --patterns y,oy,yc,ye,yce,oyce [--untie]

prints one JSON line: for each pattern, the fraction of right replies after each
`--report-every` updates (chance is 0.25 once the format is learned).

The model ties its embedding and output head, as the tiny default and Qwen2.5-0.5B do.
`--untie` gives it its own head, a copy of the embedding (`untie_word_embeddings`): with the
tie, `oy` stays at chance (seeds 0-3: 0.22, 0.31, 0.41, 0.0 after 120 updates) while `y`
learns; untied, `oy` learns like `y` (docs/algorithms.md, "Tied embeddings and generated
format tokens"). `tests/test_reply_format_learning.py` runs this bandit.

Variants (docs/notes/reply_format.md, "What the tokens after the decision cost"):
`--force-format` samples the format tokens as the right ones, `--format-credit` gives them their own
advantage, `--format-out-of-loss` masks them, `--hidden` widens the model, `--set
FIELD=VALUE` sets a `LearnerConfig` field of the RL updates (e.g. `adam_b2=0.99`, or
`init_kl_coef=0.15` for the recipes' KL to the warmed model).
"""

import argparse
import ast
import dataclasses
import json
import time

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from jaxrl_agentic.data import PackingConfig, Sample
from jaxrl_agentic.models.config import ModelConfig
from jaxrl_agentic.models.transformer import Transformer
from jaxrl_agentic.runtime.parallel import make_mesh
from jaxrl_agentic.training.learner import Learner
from jaxrl_agentic.training.learner_config import LearnerConfig

VOCAB, OPEN, CLOSE, EOS, BATCH = 32, 20, 21, 22, 64
FORMAT = {"o": OPEN, "c": CLOSE, "e": EOS}


def bandit_model(seed: int, untie: bool, hidden: int = 64):
    """(graphdef, params) of the bandit's tied model, ``hidden`` wide (heads of 16); ``untie``:
    with its own output head, a copy of the embedding (what
    ``load_pretrained(untie_word_embeddings=True)`` does)."""
    cfg = ModelConfig(vocab_size=VOCAB, hidden_size=hidden, intermediate_size=2 * hidden,
                      num_hidden_layers=2, num_attention_heads=hidden // 16,
                      num_key_value_heads=hidden // 32, head_dim=16)
    tied = Transformer(cfg, rngs=nnx.Rngs(seed))
    if not untie:
        return nnx.split(tied)
    model = Transformer(dataclasses.replace(cfg, tie_word_embeddings=False),
                        rngs=nnx.Rngs(seed))
    nnx.update(model, nnx.state(tied))
    model.lm_head.kernel[...] = tied.embed.embedding[...].T
    return nnx.split(model)


def run_pattern(pattern: str, *, updates: int, warmup_steps: int, lr: float, seed: int,
                report_every: int, untie: bool = False, loss_reduction: str = "token_mean",
                format_in_loss: bool = True, valid_out: list | None = None,
                max_grad_norm: float = 1.0, broken_reward: float = -1.0,
                grad_norms_out: list | None = None,
                relative_grad_clip: float | None = None,
                format_credit: bool = False, hidden: int = 64,
                force_format: bool = False, rl_overrides: dict | None = None) -> list[float]:
    """Fraction of right replies every `report_every` PPO updates. `format_in_loss=False`
    keeps the format tokens out of the RL loss (the warm-up still trains them);
    `format_credit` gives the format tokens their own advantage, the reply's validity
    centred over the batch, v − mean v (0 when every reply is well formed), and the
    decision token the task's;
    `valid_out` collects the fraction of well-formed replies at the same points;
    `grad_norms_out` every update's gradient norm before clipping; `force_format` samples
    the format tokens as the right ones (no broken replies; their logprobs stay the model's);
    `rl_overrides`: further `LearnerConfig` fields of the RL updates (e.g. init_kl_coef,
    a KL penalty towards the warmed model, as the recipes use)."""
    graphdef, params = bandit_model(seed, untie, hidden)
    mesh = make_mesh(devices=jax.local_devices())
    # All 64 samples (≤ 12 tokens each) in one packed row.
    common = dict(mini_batch_size=BATCH, max_grad_norm=max_grad_norm, seed=seed,
                  packing=PackingConfig(micro_batch_max_tokens=1024, sequence_length=16))
    rng = np.random.default_rng(seed)

    @jax.jit
    def next_logprobs(params, tokens):
        positions = jnp.broadcast_to(jnp.arange(tokens.shape[1]), tokens.shape)
        logits = nnx.merge(graphdef, params)(tokens, positions)[:, -1]
        return jax.nn.log_softmax(logits.astype(jnp.float32))

    def prompts():
        x = rng.integers(2, 6, BATCH)
        return x, np.concatenate([np.ones((BATCH, 1), int), x[:, None],
                                  rng.integers(23, VOCAB, (BATCH, 6))], axis=1)

    def sample(prompt, reply, logprobs, advantage, only_decision=False, format_advantage=None):
        tokens = np.concatenate([prompt, reply]).astype(np.int32)
        mask = np.zeros(len(tokens), np.float32)
        if only_decision:
            mask[len(prompt) + pattern.index("y")] = 1.0
        else:
            mask[len(prompt):] = 1.0
        old = np.zeros(len(tokens), np.float32)
        old[len(prompt):] = logprobs
        advantages = mask * advantage
        if format_advantage is not None:
            for k, ch in enumerate(pattern):
                if ch in FORMAT:
                    advantages[len(prompt) + k] = mask[len(prompt) + k] * format_advantage
        return Sample(tokens=tokens, loss_mask=mask, old_logprobs=old,
                      advantages=advantages, traj_id=0)

    warm = Learner(graphdef, params, LearnerConfig(learning_rate=2e-3,
                                                   recompute_old_logprobs=True, **common), mesh)
    for _ in range(warmup_steps):
        _, p = prompts()
        ys = rng.integers(6, 10, BATCH)
        warm.step([sample(p[i], [FORMAT.get(ch, ys[i]) for ch in pattern],
                          np.zeros(len(pattern)), 1.0) for i in range(BATCH)], [2e-3])
    learner = Learner(graphdef, warm.params, LearnerConfig(
        learning_rate=lr, loss_reduction=loss_reduction,
        relative_grad_clip=relative_grad_clip, **{**common, **(rl_overrides or {})}), mesh)
    right_fraction = []
    for update in range(updates):
        x, seq = prompts()
        logprobs = np.zeros((BATCH, len(pattern)))
        for k in range(len(pattern)):
            lp = np.asarray(next_logprobs(learner.params, jnp.asarray(seq)), np.float64)
            probs = np.exp(lp) / np.exp(lp).sum(axis=1, keepdims=True)
            tokens = np.array([rng.choice(VOCAB, p=p) for p in probs])
            if force_format and pattern[k] in FORMAT:
                tokens[:] = FORMAT[pattern[k]]
            logprobs[:, k] = lp[np.arange(BATCH), tokens]
            seq = np.concatenate([seq, tokens[:, None]], axis=1)
        reply = seq[:, -len(pattern):]
        valid = np.ones(BATCH, bool)
        for k, ch in enumerate(pattern):
            if ch in FORMAT:
                valid &= reply[:, k] == FORMAT[ch]
        right = valid & (reply[:, pattern.index("y")] == x + 4)
        reward = np.where(valid, right.astype(np.float64), broken_reward)
        advantage = (reward - reward.mean()) / (reward.std() + 1e-6)
        # Not divided by the std: one broken reply among 64 would get −7.9.
        format_advantage = valid - valid.mean()
        metrics = learner.step([
            sample(seq[i, :-len(pattern)], reply[i], logprobs[i], advantage[i],
                   only_decision=not format_in_loss,
                   format_advantage=format_advantage[i] if format_credit else None)
            for i in range(BATCH)], [lr])
        if grad_norms_out is not None:
            grad_norms_out.append(metrics["actor/grad_norm"])
        if (update + 1) % report_every == 0:
            right_fraction.append(round(float(right.mean()), 3))
            if valid_out is not None:
                valid_out.append(round(float(valid.mean()), 3))
    return right_fraction


def main():
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--patterns", default="y,oy,yc,ye,yce,oyce")
    parser.add_argument("--updates", type=int, default=150)
    parser.add_argument("--warmup-steps", type=int, default=100)
    parser.add_argument("--lr", type=float, default=1e-3)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--report-every", type=int, default=30)
    parser.add_argument("--untie", action="store_true",
                        help="give the model its own output head (a copy of the embedding)")
    parser.add_argument("--loss-reduction", default="token_mean",
                        help="LearnerConfig.loss_reduction of the RL updates")
    parser.add_argument("--format-out-of-loss", action="store_true",
                        help="RL loss on the decision token only (format tokens masked)")
    parser.add_argument("--max-grad-norm", type=float, default=1.0)
    parser.add_argument("--relative-grad-clip", type=float, default=None,
                        help="LearnerConfig.relative_grad_clip of the RL updates (off by default)")
    parser.add_argument("--broken-reward", type=float, default=-1.0,
                        help="reward of a reply whose format tokens are wrong")
    parser.add_argument("--format-credit", action="store_true",
                        help="format tokens get the reply's centred validity as their "
                             "advantage, the decision the task's")
    parser.add_argument("--hidden", type=int, default=64,
                        help="model width (a multiple of 32; two layers, heads of 16)")
    parser.add_argument("--force-format", action="store_true",
                        help="sample the format tokens as the right ones (no broken replies)")
    parser.add_argument("--set", action="append", default=[], metavar="FIELD=VALUE",
                        help="a LearnerConfig field of the RL updates, e.g. adam_b2=0.99 "
                             "or init_kl_coef=0.15 (the recipes' KL to the warmed model)")
    args = parser.parse_args()
    overrides = {}
    for item in args.set:
        field, sep, value = item.partition("=")
        if not sep:
            parser.error(f"--set {item!r}: expected FIELD=VALUE")
        overrides[field] = ast.literal_eval(value)
    start = time.perf_counter()
    out, valid = {}, {}
    for pattern in args.patterns.split(","):
        if pattern.count("y") != 1 or set(pattern) - set("yoce"):
            parser.error(f"pattern {pattern!r}: one 'y' and any of 'o', 'c', 'e'")
        out[pattern] = run_pattern(pattern, updates=args.updates,
                                   warmup_steps=args.warmup_steps, lr=args.lr,
                                   seed=args.seed, report_every=args.report_every,
                                   untie=args.untie, loss_reduction=args.loss_reduction,
                                   format_in_loss=not args.format_out_of_loss,
                                   valid_out=valid.setdefault(pattern, []),
                                   max_grad_norm=args.max_grad_norm,
                                   broken_reward=args.broken_reward,
                                   relative_grad_clip=args.relative_grad_clip,
                                   format_credit=args.format_credit,
                                   hidden=args.hidden, force_format=args.force_format,
                                   rl_overrides=overrides)
    print(json.dumps({f"right_fraction_every_{args.report_every}_updates": out,
                      "valid_fraction": valid, "loss_reduction": args.loss_reduction,
                      "format_in_loss": not args.format_out_of_loss,
                      "max_grad_norm": args.max_grad_norm,
                      "relative_grad_clip": args.relative_grad_clip,
                      "broken_reward": args.broken_reward,
                      "format_credit": args.format_credit, "hidden": args.hidden,
                      "force_format": args.force_format, "set": overrides,
                      "updates": args.updates, "warmup_steps": args.warmup_steps,
                      "lr": args.lr, "seed": args.seed, "untie": args.untie,
                      "seconds": round(time.perf_counter() - start, 1)}))


if __name__ == "__main__":
    main()
