"""The JAX sampler and its sessions are what the rollout asks of a sampler backend."""

from flax import nnx

from jaxrl_agentic.models import Transformer
from jaxrl_agentic.sampling import (
    Sampler,
    SamplerBackend,
    SamplerSession,
    Session,
    ShardedSession,
)
from tests.sampling.test_jax_sampler import CFG


def test_the_jax_sampler_and_both_sessions_follow_the_protocol():
    sampler = Sampler(Transformer(CFG, rngs=nnx.Rngs(0)), max_total_len=64, decode_threads=2,
                      min_rows_per_thread=1)
    assert isinstance(sampler, SamplerBackend)
    sessions = [sampler.new_session(1), sampler.new_session(2)]
    assert [type(s) for s in sessions] == [Session, ShardedSession]
    assert all(isinstance(s, SamplerSession) for s in sessions)
