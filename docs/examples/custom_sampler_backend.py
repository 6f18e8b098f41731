"""FrozenLake with a sampler backend of its own: the JAX sampler, traced.

    python -m jaxrl_agentic.train --config docs/examples/custom_sampler_backend.py

A backend is anything with the `SamplerBackend` methods (`new_session`, `generate`,
`set_params`; jaxrl_agentic/sampling/protocol.py) that a registered factory builds from the
policy model. This one reuses the in-process JAX sampler and records, for every reply
batch the rollout asks for, how many rows it decoded and how many tokens they generated:
the numbers a throughput question starts from. A backend serving the model elsewhere (an
inference server, another device pool) registers the same way; it must return the
logprobs the learner recomputes.
"""

import os

from jaxrl_agentic.config import recipe_config
from jaxrl_agentic.sampling import Sampler, register_sampler_backend

TRACE: list[dict] = []  # one entry per reply batch: {"rows": n, "reply_tokens": m}


class TracedSession:
    """A session of the JAX sampler whose replies are counted into `trace`."""

    def __init__(self, inner, trace: list[dict]):
        self._inner, self._trace = inner, trace

    def __getattr__(self, name):  # extend, reset_row, length, …: the sampler's own
        return getattr(self._inner, name)

    def generate(self, rows, **kwargs):
        result = self._inner.generate(rows, **kwargs)
        self._trace.append({"rows": len(rows),
                            "reply_tokens": sum(len(t) for t in result.tokens)})
        return result


class TracedSampler(Sampler):
    """The JAX sampler (KV cache, prefix reuse), its sessions traced."""

    def __init__(self, *args, trace: list[dict], **kwargs):
        super().__init__(*args, **kwargs)
        self.trace = trace

    def new_session(self, num_rows: int, reserve: int = 0):
        return TracedSession(super().new_session(num_rows, reserve), self.trace)


def traced_backend(model, tokenizer, *, max_total_len, mesh, logprob_under_filter,
                   precompile_slots):
    return TracedSampler(model, tokenizer, max_total_len=max_total_len, mesh=mesh,
                         logprob_under_filter=logprob_under_filter,
                         precompile_slots=precompile_slots, trace=TRACE)


# replace=True: a config file may be loaded more than once in a process.
register_sampler_backend("traced_jax", traced_backend, replace=True)


def get_config():
    c = recipe_config(os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "..",
                                   "configs", "frozen_lake.py"))
    c.exp_name = "frozen_lake_traced_sampler"
    c.sampler_backend = "traced_jax"
    return c
