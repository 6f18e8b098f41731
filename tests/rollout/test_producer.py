"""The background rollout producer: bounded staleness, overlap, errors (no sleeps: events)."""

import random
import threading
import time

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


# ---- in-flight updates: the producer is the rollouts' live policy ------------------------------

class ChunkedRollout:
    """`produce(step, policy)` of in-flight mode: each of `episodes` episodes reads the live
    policy at every one of its `chunks` chunk boundaries and records the version per token
    (`tokens` a chunk); environment latencies are random pauses between chunks."""

    def __init__(self, rng, episodes=3, chunks=4, tokens=2, max_pause=0.002):
        self.rng, self.lock = rng, threading.Lock()
        self.episodes, self.chunks, self.tokens = episodes, chunks, tokens
        self.max_pause = max_pause

    def pause(self):
        with self.lock:
            seconds = self.rng.uniform(0, self.max_pause)
        time.sleep(seconds)  # an environment's latency, not a wait for another thread

    def __call__(self, step, policy):
        trajs = []
        for _ in range(self.episodes):
            versions = []
            for _ in range(self.chunks):
                version, params = policy.current()
                assert params == f"v{version}"  # the params of that very version
                versions += [version] * self.tokens
                self.pause()
            trajs.append(versions)
        return trajs


@pytest.mark.parametrize("lag", [0, 1, 2, 3])
@pytest.mark.parametrize("seed", [0, 1, 2])
def test_in_flight_lag_never_exceeds_the_bound_under_random_latencies(lag, seed):
    """Property: whatever the environment and learner latencies, every token trained at
    version j (step j) was sampled by a version ≥ j − lag; with lag 0 every token is
    exactly version j (the synchronous run)."""
    rng = random.Random(seed)
    produce = ChunkedRollout(rng)
    producer = RolloutProducer(produce, ratio=lag, first_step=0, version=0, params="v0",
                               in_flight=True)
    spans = []
    try:
        for step in range(10):
            produced, _ = producer.take(step)
            for versions in produced.trajectories:
                assert all(step - lag <= v <= step for v in versions), (step, versions)
                assert versions == sorted(versions)  # a token never goes back a version
                spans.append(len(set(versions)))
            assert produced.version >= step - lag
            time.sleep(rng.uniform(0, 0.004))  # the learner's update
            producer.publish(step + 1, f"v{step + 1}")
    finally:
        producer.close()
    if lag == 0:
        assert set(spans) == {1}


def test_an_update_reaches_a_rollout_at_its_next_chunk():
    """The learner publishes while step 1's rollout is between two chunks: the chunks
    after it decode with the new version, without the rollout pausing or restarting."""
    between = threading.Event()
    published = threading.Event()

    def produce(step, policy):
        first = policy.current()
        if step == 1:
            between.set()
            assert published.wait(timeout=30)
        return [(first, policy.current())]

    producer = RolloutProducer(produce, ratio=1, first_step=0, version=0, params="v0",
                               in_flight=True)
    try:
        assert producer.take(0)[0].trajectories == [((0, "v0"), (0, "v0"))]
        assert between.wait(timeout=30)  # step 1 started at version 0 (lag bound 1)
        producer.publish(1, "v1")
        published.set()
        produced, _ = producer.take(1)
        assert produced.version == 0
        assert produced.trajectories == [((0, "v0"), (1, "v1"))]
    finally:
        producer.close()


def test_close_counts_the_episodes_played_ahead_and_not_taken():
    played = {step: threading.Event() for step in range(3)}

    def produce(step, policy):
        played[step].set()  # the episodes exist: stored or, after close, counted
        return [step] * 4

    producer = RolloutProducer(produce, ratio=2, first_step=0, version=0, params="v0",
                               in_flight=True)
    producer.take(0)
    # Steps 1 and 2 are admitted at version 0 (lag 2) and played; nobody takes them.
    assert played[1].wait(timeout=30) and played[2].wait(timeout=30)
    assert producer.close() == 8


def test_a_negative_lag_bound_is_rejected():
    with pytest.raises(ValueError, match="max_policy_lag"):
        RolloutProducer(lambda s, p: [], ratio=-1, first_step=0, version=0, params=None,
                        in_flight=True)
