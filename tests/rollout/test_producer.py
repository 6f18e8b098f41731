"""The background rollout producer: bounded staleness, overlap, errors (no sleeps: events)."""

import threading

import pytest

from jaxrl_agentic.rollout.producer import RolloutProducer


class Recorder:
    """`produce(step, params)` that records which params version each step saw."""

    def __init__(self):
        self.seen = {}
        self.started = {}
        self.gate = {}

    def __call__(self, step, params):
        self.started.setdefault(step, threading.Event()).set()
        if step in self.gate:
            self.gate[step].wait(timeout=30)
        self.seen[step] = params
        return [f"traj-{step}"]


@pytest.mark.parametrize("ratio", [1, 2, 3])
def test_staleness_never_exceeds_the_ratio(ratio):
    produce = Recorder()
    producer = RolloutProducer(produce, ratio=ratio, first_step=0, version=0, params=0)
    try:
        for step in range(8):
            produced, _ = producer.take(step)
            assert produced.trajectories == [f"traj-{step}"]
            staleness = step - produced.version
            assert 0 <= staleness <= ratio
            assert produce.seen[step] == produced.version  # the params of that version
            producer.publish(step + 1, step + 1)  # the learner finished step `step`
    finally:
        producer.close()


def test_next_rollout_runs_while_the_learner_trains():
    produce = Recorder()
    producer = RolloutProducer(produce, ratio=1, first_step=5, version=5, params="v5")
    try:
        produced, _ = producer.take(5)
        # The learner has not published version 6, yet step 6 is already being produced.
        assert produce.started.setdefault(6, threading.Event()).wait(timeout=30)
        assert produced.step == 5 and produced.version == 5
        producer.publish(6, "v6")
        produced, _ = producer.take(6)
        assert produced.version == 5 and produce.seen[6] == "v5"
        # Step 7 may not start before version 6 exists, and then uses the newest params.
        producer.publish(7, "v7")
        produced, _ = producer.take(7)
        assert produced.version in (6, 7)
    finally:
        producer.close()


def test_producer_errors_surface_in_take():
    def produce(step, params):
        raise ValueError("env exploded")

    producer = RolloutProducer(produce, ratio=1, first_step=0, version=0, params=None)
    with pytest.raises(RuntimeError, match="rollout producer failed: ValueError"):
        producer.take(0)
    producer.close()


def test_ratio_zero_is_rejected():
    with pytest.raises(ValueError, match="async_generation_ratio"):
        RolloutProducer(lambda s, p: [], ratio=0, first_step=0, version=0, params=None)
