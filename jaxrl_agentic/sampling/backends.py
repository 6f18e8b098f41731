"""Sampler backends by name: the registry ``sampler_backend=`` reads, open to any recipe.

A backend factory takes the policy model (an nnx ``Transformer`` holding the initial
params), its tokenizer and the pipeline's sampling options, and returns a
:class:`~jaxrl_agentic.sampling.protocol.SamplerBackend`:

    def my_backend(model, tokenizer, *, max_total_len, mesh, logprob_under_filter,
                   precompile_slots) -> SamplerBackend: ...

    register_sampler_backend("my_backend", my_backend)

The learner starts from the same model's params; after each update the pipeline hands the
backend the new ones (``set_params``, or ``params=`` per call). The backend's logprobs must
be those the learner recomputes (docs/architecture.md, "Contracts").
Continuous batching (``rollout_batching="continuous"``) decodes through the JAX sampler's
slot programs, so it needs a backend that is a ``Sampler`` (or subclasses it).
"""

from __future__ import annotations

from collections.abc import Callable

from jaxrl_agentic.registration import same_registration
from jaxrl_agentic.sampling.jax_sampler import Sampler
from jaxrl_agentic.sampling.protocol import SamplerBackend


def _jax_backend(model, tokenizer, *, max_total_len: int, mesh=None,
                 logprob_under_filter: bool = False, precompile_slots: bool = True) -> Sampler:
    """The in-process JAX sampler (KV cache, prefix reuse, slot decoding)."""
    return Sampler(model, tokenizer, max_total_len=max_total_len, mesh=mesh,
                   logprob_under_filter=logprob_under_filter,
                   precompile_slots=precompile_slots)


_BACKENDS: dict[str, Callable[..., SamplerBackend]] = {"jax": _jax_backend}


def register_sampler_backend(name: str, factory: Callable[..., SamplerBackend], *,
                             replace: bool = False) -> None:
    """Adds ``name`` (module doc for ``factory``'s signature). The same factory again (a
    recipe file read twice: ``registration.same_registration``) changes nothing; another
    one under a registered name is an error unless ``replace``."""
    if not isinstance(name, str) or not name:
        raise ValueError(f"a sampler backend needs a non-empty name, got {name!r}")
    if not callable(factory):
        raise TypeError(f"sampler backend {name!r}: the factory must be callable")
    if name in _BACKENDS and not replace:
        if same_registration(_BACKENDS[name], factory):
            return
        raise ValueError(f"sampler backend {name!r} is already registered")
    _BACKENDS[name] = factory


def sampler_backend_names() -> tuple[str, ...]:
    return tuple(_BACKENDS)


def make_sampler_backend(name: str, model, tokenizer, **options) -> SamplerBackend:
    """The backend ``name`` built for ``model``; a TypeError if what the factory returns does
    not have the protocol's methods."""
    if name not in _BACKENDS:
        raise ValueError(f"unknown sampler_backend {name!r}; choose one of "
                         f"{', '.join(sampler_backend_names())}")
    backend = _BACKENDS[name](model, tokenizer, **options)
    if not isinstance(backend, SamplerBackend):
        raise TypeError(f"sampler backend {name!r} returned {type(backend).__name__}, which "
                        "lacks SamplerBackend's methods (new_session, generate, set_params)")
    return backend
