"""The run's memory plan holds a device's share of the sampler's cache and logits as the
sampler places them (rows over data × fsdp, kv heads over tensor), by hand arithmetic."""

import pytest
from jax.sharding import AbstractMesh

from jaxrl_agentic.config import default_config, validate
from jaxrl_agentic.models.qwen_fixture import qwen25_config
from jaxrl_agentic.pipeline.run_plan import max_total_len, run_memory_plan
from jaxrl_agentic.run_config import as_run_config

AXES = ("data", "fsdp", "tensor", "context")


@pytest.mark.parametrize("shape, cache_split, logits_split", [
    ((1, 1, 1, 1), 1, 1),
    ((4, 1, 1, 1), 4, 4),   # 64 rows over 4
    ((2, 2, 2, 1), 8, 4),   # rows over 4, Qwen's 2 kv heads over 2
    ((3, 1, 1, 1), 1, 1),   # 64 rows do not split 3 ways: every device holds them all
])
def test_a_device_holds_its_share_of_the_sampler_cache(shape, cache_split, logits_split):
    c = default_config()
    validate(c)
    cfg, model = as_run_config(c), qwen25_config()
    rows, n = cfg.train.manager.num_episodes, max_total_len(cfg)
    assert rows == 64
    plan = dict(run_memory_plan(cfg, model, AbstractMesh(shape, AXES), 16e9,
                                platform="tpu").items)
    whole = model.num_hidden_layers * 2 * rows * model.num_key_value_heads \
        * model.head_dim * n * 4  # fp32 compute
    assert plan["kv cache"] == whole / cache_split
    assert plan["sampler logits"] == rows * model.vocab_size * 4 / logits_split
