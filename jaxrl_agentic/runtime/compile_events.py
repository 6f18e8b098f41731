"""Counting XLA compilations (and jit traces, lowerings, persistent-cache hits) while active.

Used by `tests/test_recompilation.py` (nothing compiles after warm-up) and by
`scripts/bench/bench_pipeline.py` (`new_compilations_after_warmup`, per step and per bucket).

`CompileEvents` is a context manager that registers `jax.monitoring` listeners and records
one `(kind, fun_name, label)` event each time JAX reports:

* ``compile`` — `/jax/core/compile/backend_compile_duration`, recorded around
  `compile_or_get_cached` for every program missing from the process' in-memory executable
  cache, whether XLA then compiles it or the persistent compilation cache supplies it (so
  a persistent-cache hit still counts as a new program);
* ``cache_hit`` — `/jax/compilation_cache/cache_hits`: one of those came from disk
  (``fun_name`` is "");
* ``trace`` / ``lower`` — `/jax/core/compile/jaxpr_trace_duration` and
  `jaxpr_to_mlir_module_duration`: jit traces and lowerings (a retrace can happen without
  a new executable).

``label`` is an optional callable read at each event (bench_pipeline passes its current
timing bucket); without one the label is "".
"""

from __future__ import annotations

from collections.abc import Callable

import jax

BACKEND_COMPILE = "/jax/core/compile/backend_compile_duration"
JAXPR_TRACE = "/jax/core/compile/jaxpr_trace_duration"
LOWERING = "/jax/core/compile/jaxpr_to_mlir_module_duration"
CACHE_HIT = "/jax/compilation_cache/cache_hits"
_DURATION_KINDS = {BACKEND_COMPILE: "compile", JAXPR_TRACE: "trace", LOWERING: "lower"}


class CompileEvents:
    """`(kind, fun_name, label)` events recorded while active (see the module docstring)."""

    def __init__(self, label: Callable[[], str] | None = None):
        self.label = label
        self.events: list[tuple[str, str, str]] = []

    def _record(self, kind: str, name: str) -> None:
        self.events.append((kind, name, self.label() if self.label else ""))

    def _on_duration(self, event, duration, **kwargs):
        del duration
        kind = _DURATION_KINDS.get(event)
        if kind:
            self._record(kind, str(kwargs.get("fun_name", "?")))

    def _on_event(self, event, **kwargs):
        del kwargs
        if event == CACHE_HIT:
            self._record("cache_hit", "")

    def __enter__(self):
        jax.monitoring.register_event_duration_secs_listener(self._on_duration)
        jax.monitoring.register_event_listener(self._on_event)
        return self

    def __exit__(self, *exc):
        jax.monitoring.unregister_event_duration_listener(self._on_duration)
        jax.monitoring.unregister_event_listener(self._on_event)

    def mark(self) -> int:
        """A position in the event list, for `since`."""
        return len(self.events)

    def since(self, mark: int, kind: str) -> list[tuple[str, str]]:
        """`(fun_name, label)` of the `kind` events recorded after `mark`."""
        return [(name, label) for k, name, label in self.events[mark:] if k == kind]

    @property
    def programs(self) -> list[str]:
        """Names of the programs compiled (or loaded from the persistent cache), in order."""
        return [name for name, _ in self.since(0, "compile")]

    @property
    def cache_hits(self) -> int:
        """How many programs came from the persistent compilation cache."""
        return len(self.since(0, "cache_hit"))
