"""In bf16 compute the sampler's logprobs are the learner's recomputation, to float32 noise.

`rollout/logprob_mismatch` compares the two every step. Before `pallas_kernels._same_bits`
they were 2.6e-3 apart (mean |Δ logprob|) at the Qwen2.5-0.5B shape and ~6e-4 at this test's
small one: XLA:CPU summed rows (RMSNorm, softmax) and evaluated fused elementwise ops to
other last bits in the sampler's programs than in the learner's, and bf16 roundings of the
matmul inputs spread those bits (docs/benchmarks.md, "bf16 agreement"). What is left is the
LM head's float32 logsumexp over the vocabulary, summed in a different shape on each side
(≤ 1e-6 per token)."""

import numpy as np
from flax import nnx

from jaxrl_agentic.data import PackingConfig, Sample
from jaxrl_agentic.learner import Learner, LearnerConfig
from jaxrl_agentic.models import ModelConfig, Transformer
from jaxrl_agentic.sampler import Sampler
from pallas_kernels.segment_attention import BLOCK


def _gap(prompt_len: int, row: int) -> tuple[float, float]:
    cfg = ModelConfig(model_type="qwen2", vocab_size=512, hidden_size=128, intermediate_size=384,
                      num_hidden_layers=4, num_attention_heads=4, num_key_value_heads=2,
                      head_dim=32, attention_bias=True, tie_word_embeddings=True,
                      dtype="bfloat16", param_dtype="float32")
    model = Transformer(cfg, rngs=nnx.Rngs(3))
    rng = np.random.default_rng(0)
    prompts = [rng.integers(0, 500, prompt_len).tolist() for _ in range(4)]
    new = 16
    out = Sampler(model, max_total_len=prompt_len + new + 16, eos_token_id=-1).generate(
        prompts, max_new_tokens=new, temperature=1.0, seed=1)
    samples = []
    for prompt, tokens, logprobs in zip(prompts, out.tokens, out.logprobs, strict=True):
        mask = np.r_[np.zeros(len(prompt)), np.ones(len(tokens))]
        samples.append(Sample(tokens=np.array(prompt + list(tokens)), loss_mask=mask,
                              old_logprobs=np.r_[np.zeros(len(prompt)), logprobs],
                              advantages=mask, prompt_len=len(prompt)))
    graphdef, params = nnx.split(model)
    # Samples start at key-block boundaries, as the pipeline packs them in bf16 on CPU
    # (`typed_configs.sample_align`): the learner's key blocks are then the sampler's.
    packing = PackingConfig(micro_batch_max_tokens=row, sequence_length=row, sample_align=BLOCK)
    recomputed = Learner(graphdef, params, LearnerConfig(packing=packing)).sample_logprobs(samples)
    gaps = np.concatenate([np.abs(s.old_logprobs - np.asarray(r))[s.loss_mask > 0]
                           for s, r in zip(samples, recomputed, strict=True)])
    return float(gaps.mean()), float(gaps.max())


def test_bf16_sampler_and_learner_logprobs_agree():
    """Prompts of 200 tokens (two key blocks, the second ragged) and of 100 (a cache of one
    block, which the sampler once ran as a dense softmax), learner rows of 1,024."""
    for prompt_len in (200, 100):
        mean, worst = _gap(prompt_len, row=1024)
        assert mean <= 1e-5 and worst <= 1e-4, (prompt_len, mean, worst)
