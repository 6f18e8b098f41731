"""In bf16 compute the sampler's logprobs are the learner's recomputation, to float32 noise.

`rollout/logprob_mismatch` compares the two every step. Before `pallas_kernels._same_bits`
they were 2.6e-3 apart (mean |Δ logprob|) at the Qwen2.5-0.5B shape and ~6e-4 at this test's
small one: XLA:CPU summed rows (RMSNorm, softmax) and evaluated fused elementwise ops to
other last bits in the sampler's programs than in the learner's, and bf16 roundings of the
matmul inputs spread those bits (docs/benchmarks.md, "bf16 agreement"). What is left is the
LM head's float32 logsumexp over the vocabulary, summed in a different shape on each side
(≤ 1e-6 per token). The measurement is `scripts/analysis/bf16_gap.py`'s, which gives the
documented figures at the real shape."""

import numpy as np
from flax import nnx

from jaxrl_agentic.models import ModelConfig, Transformer
from pallas_kernels.segment_attention import BLOCK
from tests.conftest import load_script


def test_bf16_sampler_and_learner_logprobs_agree():
    """Prompts of 200 tokens (two key blocks, the second ragged) and of 100 (a cache of one
    block, which the sampler once ran as a dense softmax), learner rows of 1,024 with each
    sample at a key-block boundary, as the pipeline packs them in bf16 on CPU
    (`run_config.sample_align`): the learner's key blocks are then the sampler's."""
    gap = load_script("scripts/analysis/bf16_gap.py")
    cfg = ModelConfig(model_type="qwen2", vocab_size=512, hidden_size=128, intermediate_size=384,
                      num_hidden_layers=4, num_attention_heads=4, num_key_value_heads=2,
                      head_dim=32, attention_bias=True, tie_word_embeddings=True,
                      dtype="bfloat16", param_dtype="float32")
    model = Transformer(cfg, rngs=nnx.Rngs(3))
    rng = np.random.default_rng(0)
    for prompt_len in (200, 100):
        prompts = [rng.integers(0, 500, prompt_len).tolist() for _ in range(4)]
        samples = gap.sampled_samples(model, prompts, new_tokens=16)
        sampled = gap.loss_token_values([s.old_logprobs for s in samples], samples)
        diff = np.abs(sampled - gap.recomputed(model, samples, row=1024, sample_align=BLOCK))
        assert diff.mean() <= 1e-5 and diff.max() <= 1e-4, (prompt_len, diff.mean(), diff.max())
