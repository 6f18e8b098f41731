"""Named timing spans over the library's work, for benchmarks and profiling runs.

The library marks where each kind of work happens; a benchmark installs a recorder and
reads where the time went, without patching the library:

    with timing.span("rollout/prefill"):
        logits = timing.ready(prefill(...))  # device time lands in this span

    timer = timing.ExclusiveTimer()
    with timing.recording(timer):
        pipeline.train_step()
    timer.take()  # {"rollout/prefill": 1.2, "learner": 3.4, ...} exclusive seconds

With no recorder installed (every training run), ``span`` returns one shared null context
after a module-level ``None`` check, ``spanned`` adds that check to a call, and ``ready``
returns its argument without waiting, so asynchronous dispatch is untouched.

**Span names** (``scripts/bench/bench_pipeline.py`` reports them as its buckets):

    rollout/prefill   sampling.Session.prefill
    rollout/decode    sampling.Session.generate, less its prefill
    rollout/env       env reset/step/select and their host copies, first/feedback messages,
                      parse_action, state_hash, episode_metrics (rollout/loop.py); the
                      thread-pool env calls (rollout/python_runner.py)
    rollout/tokenize  ChatFormatter.first_prompt / next_prompt / decode_reply
    rollout/other     Pipeline.rollout, less the above
    samples           Pipeline.make_samples, Pipeline.fold_kl_into_rewards
    learner           Learner.step, called from Pipeline.train_step
    critic            Critic.step, called from Pipeline.train_step
    pipeline_other    Pipeline.train_step, less the above
    eval              Pipeline.evaluate
    logging           train.run's metrics, text, frames and GIF
    checkpoint        train.run's Checkpointer.save

A recorder is any object with ``enter(name)`` and ``exit(name)``; spans call them on the
thread that runs the span, so a recorder must be thread-safe.
"""

from __future__ import annotations

import collections
import contextlib
import functools
import threading
import time
from collections.abc import Callable, Collection, Iterator
from typing import Protocol, TypeVar

T = TypeVar("T")


class Recorder(Protocol):
    def enter(self, name: str) -> None: ...

    def exit(self, name: str) -> None: ...


_recorder: Recorder | None = None
_NULL = contextlib.nullcontext()


class _Span:
    __slots__ = ("recorder", "name")

    def __init__(self, recorder: Recorder, name: str):
        self.recorder, self.name = recorder, name

    def __enter__(self) -> None:
        self.recorder.enter(self.name)

    def __exit__(self, *exc) -> None:
        self.recorder.exit(self.name)


def span(name: str) -> contextlib.AbstractContextManager:
    """A context manager that reports ``name`` to the installed recorder (if any)."""
    recorder = _recorder
    if recorder is None:
        return _NULL
    return _Span(recorder, name)


def spanned(name: str) -> Callable[[Callable[..., T]], Callable[..., T]]:
    """Decorator: every call of the function runs inside ``span(name)``."""

    def decorate(fn):
        @functools.wraps(fn)
        def wrapper(*args, **kwargs):
            if _recorder is None:
                return fn(*args, **kwargs)
            with span(name):
                return fn(*args, **kwargs)

        return wrapper

    return decorate


def ready(x: T) -> T:
    """``x``, after waiting for its device arrays when a recorder is installed (so their
    device time is charged to the span that launched them, not to the next one to block);
    without a recorder, ``x`` at once."""
    if _recorder is not None:
        import jax  # only while recording: this module stays import-light

        jax.block_until_ready(x)
    return x


@contextlib.contextmanager
def recording(recorder: Recorder) -> Iterator[Recorder]:
    """Installs ``recorder`` for every thread until the block ends (then the previous one)."""
    global _recorder
    previous, _recorder = _recorder, recorder
    try:
        yield recorder
    finally:
        _recorder = previous


class ExclusiveTimer:
    """Exclusive wall time per span name: a span's time less that of the spans nested in it.

    Between two span events the elapsed time goes to the innermost open span, so the totals
    add up to the time spent inside outermost spans. Built for one driving thread (the one
    that made the timer) that may hand work to helper threads and wait for it, as the
    sampler's row blocks do: while helper threads are inside spans, the time goes to their
    innermost spans, split equally among them, and not to the waiting driver. Spans on
    helper threads nest among themselves only.

    ``absorbing``: names whose nested spans are charged to them (e.g. ``{"eval"}``: an
    evaluation's rollout is evaluation time). ``clock``: seconds, ``time.perf_counter`` by
    default (tests inject a fake one).
    """

    def __init__(self, *, absorbing: Collection[str] = (),
                 clock: Callable[[], float] = time.perf_counter):
        self.absorbing = frozenset(absorbing)
        self.clock = clock
        self.driver = threading.get_ident()
        self.totals: dict[str, float] = collections.defaultdict(float)
        self._stacks: dict[int, list[str]] = {}
        self._lock = threading.Lock()
        self._last = clock()

    @property
    def current(self) -> str:
        """The innermost open span of the calling thread, else of the driver, else
        ``"outside"`` (e.g. a label for what triggered a compilation)."""
        with self._lock:
            for thread in (threading.get_ident(), self.driver):
                stack = self._stacks.get(thread)
                if stack:
                    return self._charged(stack)
        return "outside"

    def enter(self, name: str) -> None:
        with self._lock:
            self._advance()
            self._stacks.setdefault(threading.get_ident(), []).append(name)

    def exit(self, name: str) -> None:
        with self._lock:
            self._advance()
            stack = self._stacks[threading.get_ident()]
            if stack[-1] != name:
                raise RuntimeError(f"span {name!r} ended inside span {stack[-1]!r}")
            stack.pop()
            if not stack:
                del self._stacks[threading.get_ident()]

    def take(self) -> dict[str, float]:
        """The totals so far (open spans charged up to now), reset to zero."""
        with self._lock:
            self._advance()
            out, self.totals = dict(self.totals), collections.defaultdict(float)
        return out

    def _charged(self, stack: list[str]) -> str:
        absorbing = [name for name in self._stacks.get(self.driver, ()) if name in
                     self.absorbing] or [name for name in stack if name in self.absorbing]
        return absorbing[0] if absorbing else stack[-1]

    def _advance(self) -> None:
        now = self.clock()
        elapsed, self._last = now - self._last, now
        helpers = [s for thread, s in self._stacks.items() if thread != self.driver]
        stacks = helpers or [s for s in (self._stacks.get(self.driver),) if s]
        for stack in stacks:
            self.totals[self._charged(stack)] += elapsed / len(stacks)
