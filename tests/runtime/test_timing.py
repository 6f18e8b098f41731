"""timing: spans cost nothing without a recorder; ExclusiveTimer's exclusive totals."""

import threading

import jax
import jax.numpy as jnp
import pytest

from jaxrl_agentic.runtime import timing


class FakeClock:
    def __init__(self):
        self.now = 0.0

    def __call__(self) -> float:
        return self.now

    def tick(self, seconds: float) -> None:
        self.now += seconds


class Calls:
    """A recorder that lists what it is told."""

    def __init__(self):
        self.events = []

    def enter(self, name):
        self.events.append(("enter", name))

    def exit(self, name):
        self.events.append(("exit", name))


def test_nested_spans_give_exact_exclusive_totals():
    clock = FakeClock()
    timer = timing.ExclusiveTimer(clock=clock)
    with timing.recording(timer):
        clock.tick(5.0)  # outside every span: charged to nothing
        with timing.span("step"):
            clock.tick(1.0)
            with timing.span("rollout"):
                clock.tick(2.0)
                with timing.span("prefill"):
                    clock.tick(3.0)
                clock.tick(0.5)
                with timing.span("prefill"):
                    clock.tick(1.5)
            with timing.span("learner"):
                clock.tick(4.0)
            clock.tick(0.25)
    assert timer.take() == {"step": 1.25, "rollout": 2.5, "prefill": 4.5, "learner": 4.0}
    assert timer.take() == {}  # take() resets


def test_take_charges_open_spans_up_to_now():
    clock = FakeClock()
    timer = timing.ExclusiveTimer(clock=clock)
    with timing.recording(timer), timing.span("step"):
        clock.tick(2.0)
        assert timer.take() == {"step": 2.0}
        clock.tick(1.0)
        assert timer.current == "step"
    assert timer.take() == {"step": 1.0}
    assert timer.current == "outside"


def test_absorbing_span_takes_its_nested_time():
    clock = FakeClock()
    timer = timing.ExclusiveTimer(absorbing={"eval"}, clock=clock)
    with timing.recording(timer), timing.span("eval"):
        clock.tick(1.0)
        with timing.span("prefill"):
            clock.tick(2.0)
    assert timer.take() == {"eval": 3.0}


def test_helper_threads_share_the_time_the_driver_waits():
    clock = FakeClock()
    timer = timing.ExclusiveTimer(clock=clock)
    started, go, done = threading.Barrier(3), threading.Event(), threading.Barrier(3)

    def helper(name):
        with timing.span(name):
            started.wait()
            go.wait()
        done.wait()

    with timing.recording(timer), timing.span("rollout"):
        clock.tick(1.0)
        threads = [threading.Thread(target=helper, args=(n,)) for n in ("prefill", "decode")]
        for t in threads:
            t.start()
        started.wait()  # both helpers are inside their spans
        clock.tick(4.0)  # split between them, not charged to the waiting driver
        go.set()
        done.wait()
        for t in threads:
            t.join()
    assert timer.take() == {"rollout": 1.0, "prefill": 2.0, "decode": 2.0}


def test_no_recorder_records_nothing():
    calls = Calls()
    with timing.span("before"):
        pass
    with timing.recording(calls):
        with timing.span("inside"):
            pass
    with timing.span("after"):
        pass
    assert calls.events == [("enter", "inside"), ("exit", "inside")]
    assert timing.span("anything") is timing.span("other")  # one shared null context


def test_spanned_function():
    calls = Calls()

    @timing.spanned("work")
    def work(x):
        return x + 1

    assert work(1) == 2
    with timing.recording(calls):
        assert work(2) == 3
    assert calls.events == [("enter", "work"), ("exit", "work")]


def test_ready_blocks_only_while_recording(monkeypatch):
    blocked = []
    monkeypatch.setattr(jax, "block_until_ready", lambda x: blocked.append(x) or x)
    x = jnp.ones(3)
    assert timing.ready(x) is x
    assert blocked == []
    with timing.recording(Calls()):
        assert timing.ready(x) is x
    assert blocked == [x]


def test_mismatched_exit_is_an_error():
    timer = timing.ExclusiveTimer(clock=FakeClock())
    timer.enter("a")
    timer.enter("b")
    with pytest.raises(RuntimeError, match="span 'a' ended inside span 'b'"):
        timer.exit("a")
