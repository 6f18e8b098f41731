"""The endpoint and the tiny model's sampler, shared by the serving modules (one compile of
the sampler's programs for all of them)."""

import pytest

from jaxrl_agentic.models import load_pretrained
from jaxrl_agentic.sampling import Sampler


@pytest.fixture(scope="session")
def server():
    pytest.importorskip("aiohttp")
    from jaxrl_agentic.serving import AgentServer

    s = AgentServer().start()
    yield s
    s.close()


@pytest.fixture(scope="session")
def tiny(tiny_model_dir):
    """(sampler, tokenizer) of the tiny model; slot programs compiled on first use."""
    model, tok = load_pretrained(tiny_model_dir)
    return Sampler(model, tok, max_total_len=256, precompile_slots=False), tok
