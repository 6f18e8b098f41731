"""Per-thread random states for libraries that draw from Python's and numpy's global ones.

Game libraries (TextArena among them) seed and draw from the module-level `random.*` and
`np.random.*` functions, which share one process-wide state. Episodes run on worker
threads (`rollout/python_runner.py`), so without care one episode's draws would shift
another's, and an episode would not be a function of its seed and replies.

`install()` replaces those module functions by dispatchers: on a thread inside
`own_states(states)` they draw from that episode's own `random.Random` and
`np.random.RandomState`; on every other thread from the global states, exactly as before
(the dispatcher calls the same bound method of the global instance). No lock is involved,
so a game that hangs inside a call holds nothing that other episodes need, and episodes
run concurrently.

A library that bound a function before `install()` (`from random import choice`) keeps
the global state; TextArena 0.7.4 calls them through the modules.
"""

from __future__ import annotations

import contextlib
import random
import threading

import numpy as np

# The module-level functions of `random` that are methods of its global `Random`.
_RANDOM_NAMES = tuple(sorted(
    name for name in dir(random.Random) if not name.startswith("_")
    and callable(getattr(random, name, None))
    and getattr(getattr(random, name), "__self__", None) is random._inst))
# Likewise for numpy's legacy global `RandomState` (np.random.seed, randint, choice, …).
_NUMPY_NAMES = tuple(sorted(
    name for name in dir(np.random.RandomState) if not name.startswith("_")
    and callable(getattr(np.random, name, None))
    and getattr(getattr(np.random, name), "__self__", None) is np.random.mtrand._rand))

_local = threading.local()
_install_lock = threading.Lock()
_installed = False


class States:
    """One episode's random states: a `random.Random` and a numpy `RandomState`."""

    def __init__(self, seed: int):
        self.python = random.Random(seed)
        self.numpy = np.random.RandomState(seed % 2**32)


def _dispatcher(name: str, global_method, which: str):
    def draw(*args, **kwargs):
        states = getattr(_local, "states", None)
        if states is None:
            return global_method(*args, **kwargs)
        return getattr(getattr(states, which), name)(*args, **kwargs)

    draw.__name__ = name
    draw.__doc__ = global_method.__doc__
    draw.thread_random_dispatch = True
    return draw


def install() -> None:
    """Puts the dispatchers in place (once per process; later calls do nothing)."""
    global _installed
    with _install_lock:
        if _installed:
            return
        for name in _RANDOM_NAMES:
            setattr(random, name, _dispatcher(name, getattr(random._inst, name), "python"))
        for name in _NUMPY_NAMES:
            method = getattr(np.random.mtrand._rand, name)
            setattr(np.random, name, _dispatcher(name, method, "numpy"))
        # np.random.seed is a function of its own (it seeds the global state's generator).
        np.random.seed = _dispatcher("seed", np.random.seed, "numpy")
        _installed = True


@contextlib.contextmanager
def own_states(states: States):
    """Within the block, this thread's `random.*` / `np.random.*` calls use `states`."""
    if not _installed:
        raise RuntimeError("thread_random.install() must run before own_states()")
    previous = getattr(_local, "states", None)
    _local.states = states
    try:
        yield states
    finally:
        _local.states = previous
