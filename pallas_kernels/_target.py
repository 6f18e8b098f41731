"""Interpret mode or the compiled kernel, chosen for the platform a program is compiled for.

A ``pallas_call`` runs as a Mosaic (TPU) or Triton (GPU) kernel, or with ``interpret=True``
as ordinary XLA ops, the only way it runs on a CPU. Deciding that from
``jax.default_backend()`` is wrong whenever a program is compiled for another backend than
the host's: compiled ahead of time for a TPU topology on a CPU machine (libtpu's
deviceless ``jax.experimental.topologies``), every kernel became an interpreted XLA loop,
and the fused logprob gradient needed more temporaries than the full-logits reference
(docs/tpu.md, "Compile for a TPU without one").

``lax.platform_dependent`` stages both variants and leaves the choice to lowering, where
the target is known: the program lowered for a CPU interprets, the one lowered for a TPU or
GPU holds the kernel, whatever the default backend. Only the chosen branch is lowered, so
the compiler never sees the other one (nor a conditional); the cost is tracing the kernel
twice. The wrappers call it inside their custom VJP rules where they own them, so the
conditional is never differentiated; around a library kernel with its own VJP (splash
attention) JAX differentiates the conditional, whose two branches have the same residuals.
"""

from __future__ import annotations

import functools

from jax import lax


def per_target(run, *args, interpret: bool | None = None):
    """``run(interpret, *args)``: with ``interpret`` None, ``interpret=True`` in the program
    lowered for a CPU and ``False`` in one lowered for any other platform (module
    docstring); a bool forces that mode everywhere."""
    if interpret is not None:
        return run(bool(interpret), *args)
    return lax.platform_dependent(*args, cpu=functools.partial(run, True),
                                  default=functools.partial(run, False))


__all__ = ["per_target"]
