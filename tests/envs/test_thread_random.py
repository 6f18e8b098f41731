"""Per-thread random states: inside `own_states` a thread's `random.*` / `np.random.*` draws
are its episode's own, whatever other threads draw; outside, the global streams as before."""

import random
import threading

import numpy as np

from jaxrl_agentic.envs import thread_random


def _draws(seed, barrier=None):
    """A game's draws: seeds through the module functions, then draws from both modules."""
    out = []
    with thread_random.own_states(thread_random.States(0)):
        random.seed(seed)
        np.random.seed(seed)
        for _ in range(50):
            if barrier is not None:
                barrier.wait()  # the two threads take turns draw by draw
            items = list(range(10))
            random.shuffle(items)
            out.append((random.randint(0, 99), random.choice("abc"), tuple(items),
                        int(np.random.randint(0, 1000)), float(np.random.rand())))
    return out


def _reference(seed):
    """The same draws from instances seeded as the global functions would be."""
    py, rs, out = random.Random(seed), np.random.RandomState(seed), []
    for _ in range(50):
        items = list(range(10))
        py.shuffle(items)
        out.append((py.randint(0, 99), py.choice("abc"), tuple(items),
                    int(rs.randint(0, 1000)), float(rs.rand())))
    return out


def test_interleaved_threads_draw_their_own_streams_and_leave_the_global_ones():
    thread_random.install()
    thread_random.install()  # idempotent
    random.seed(123)
    np.random.seed(123)
    global_py, global_np = random.Random(123), np.random.RandomState(123)
    barrier, results = threading.Barrier(2), {}

    def play(seed):
        results[seed] = _draws(seed, barrier)

    threads = [threading.Thread(target=play, args=(s,)) for s in (1, 2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert results[1] == _reference(1) and results[2] == _reference(2)
    assert results[1] != results[2]
    # This thread never entered own_states: its stream is the global one, untouched.
    assert [random.random() for _ in range(5)] == [global_py.random() for _ in range(5)]
    assert np.array_equal(np.random.rand(5), global_np.rand(5))


def test_the_episode_state_is_restored_after_the_block_and_nests():
    thread_random.install()
    outer, inner = thread_random.States(5), thread_random.States(6)
    with thread_random.own_states(outer):
        a = random.random()
        with thread_random.own_states(inner):
            b = random.random()
        c = random.random()
    expected_outer, expected_inner = random.Random(5), random.Random(6)
    assert (a, c) == (expected_outer.random(), expected_outer.random())
    assert b == expected_inner.random()
