"""Generation for the rollout: a sampler backend's contract and the in-process JAX backend.

    protocol.py      SamplerBackend / SamplerSession (what the rollout asks), GenerationResult
    backends.py      the backends by name (`sampler_backend=`), open to recipes
    jax_sampler.py   Sampler: the JAX backend, its compiled programs and thread pool
    sessions.py      Session / ShardedSession: token streams with a KV cache, prefix reuse
    slot_decoder.py  SlotDecoder: continuous batching over a session's rows
    draws.py         drawing a token and its logprob (shared by both decode programs)
    buckets.py       the shape buckets that bound compilation
"""

from jaxrl_agentic.sampling.backends import (
    make_sampler_backend,
    register_sampler_backend,
    sampler_backend_names,
)
from jaxrl_agentic.sampling.jax_sampler import Sampler
from jaxrl_agentic.sampling.protocol import GenerationResult, SamplerBackend, SamplerSession
from jaxrl_agentic.sampling.sessions import Session, ShardedSession
from jaxrl_agentic.sampling.slot_decoder import SlotDecoder, SlotReply

__all__ = [
    "GenerationResult",
    "Sampler",
    "SamplerBackend",
    "SamplerSession",
    "Session",
    "ShardedSession",
    "SlotDecoder",
    "SlotReply",
    "make_sampler_backend",
    "register_sampler_backend",
    "sampler_backend_names",
]
