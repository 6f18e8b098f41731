"""In-flight weight updates (`in_flight_updates`, `max_policy_lag`) through the pipeline:
every token's version recorded and within the bound, samples carrying their version range,
lag 0 identical to synchronous training, and a resumed run that keeps the bound and says
which episodes the stop left untrained.

(The bound under random latencies, and an update reaching a live rollout at its next
chunk: tests/rollout/test_producer.py and tests/rollout/test_continuous.py.)"""

import numpy as np
import pytest

from tests.test_async import comparable, make_config, resumed_step, run_steps, seeds

IN_FLIGHT = ("--config.in_flight_updates=True", "--config.decode_chunk_tokens=2")


@pytest.fixture(scope="module")
def in_flight_run(tmp_path_factory):
    """Two steps with lag bound 1, the state after step 1, and the close log."""
    c = make_config(tmp_path_factory.mktemp("in_flight"), *IN_FLIGHT)
    lines = []
    steps, snapshot = run_steps(c, 2, log=lines.append)
    return c, steps, snapshot, lines


def test_every_token_is_within_the_lag_bound_and_samples_carry_their_versions(in_flight_run):
    c, steps, _, lines = in_flight_run
    assert c.rollout_batching == "turn"  # in-flight brings continuous rollouts by itself
    for step, (metrics, trajs, samples) in enumerate(steps):
        versions = np.concatenate([t.token_versions() for t in trajs])
        assert versions.size and np.all((versions >= step - 1) & (versions <= step))
        assert metrics["off_policy/version_lag_max"] == float(step - versions.min())
        assert metrics["off_policy/version_lag_mean"] == pytest.approx(
            float(np.mean(step - versions)))
        assert metrics["off_policy/dropped"] == 0 and metrics["actor/grad_norm"] > 0
        assert metrics["off_policy/mismatch_kl"] >= 0
        by_traj = {t.traj_id: t.token_versions() for t in trajs}
        for s in samples:  # trajectory samples: the episode's oldest and newest version
            assert (s.min_version, s.max_version) == (by_traj[s.traj_id].min(),
                                                      by_traj[s.traj_id].max())
    assert steps[0][0]["off_policy/version_lag_max"] == 0  # nothing older than version 0
    # The producer ran ahead: the steps after the second were played and never trained on,
    # and the close says so (a resumed run plays them again).
    episodes = len(steps[0][1])
    closing = [line for line in lines if line.startswith("rollouts: ")]
    assert len(closing) == 1, lines
    unused = int(closing[0].split()[1])
    assert unused in (episodes, 2 * episodes), closing


def test_lag_zero_is_synchronous_training(tmp_path):
    """Step j's episodes start only after the learner finished step j − 1, and the learner
    waits for them: the same trajectories and the same metrics as the synchronous run."""
    runs = [run_steps(make_config(tmp_path / name, *extra), 2)[0] for name, extra in
            (("sync", ()), ("lag0", (*IN_FLIGHT, "--config.max_policy_lag=0")))]
    for (sync, sync_trajs, _), (lag0, lag0_trajs, _) in zip(*runs, strict=True):
        assert [t.tokens for t in sync_trajs] == [t.tokens for t in lag0_trajs]
        assert comparable(lag0) == pytest.approx(comparable(sync), abs=1e-6)
        assert lag0["off_policy/version_lag_max"] == 0


def test_resumed_run_keeps_the_bound_and_plays_the_unused_steps_again(in_flight_run):
    c, steps, snapshot, _ = in_flight_run
    metrics, trajs, _ = resumed_step(c, snapshot, log=lambda line: None)
    assert seeds(trajs) == seeds(steps[1][1])  # the same groups: none lost, none twice
    assert metrics["step"] == 2 and metrics["off_policy/version_lag_max"] == 0
    assert np.all(np.concatenate([t.token_versions() for t in trajs]) == 1)
