import numpy as np
import pytest

from jaxrl_agentic.envs import episode_metrics


def info(valid, effective, success=False):
    return {"action_is_valid": valid, "action_is_effective": effective, "success": success}


def test_metrics_of_a_hand_made_episode():
    # Turn 1 invalid reply, turn 2 bump into a wall, turns 3-4 moves, turn 4 solves it.
    rewards = [-0.1, -0.1, -0.1, 10.9]
    infos = [info(False, False), info(True, False), info(True, True), info(True, True, True)]
    metrics = episode_metrics(rewards, infos)
    assert metrics == {
        "success": 1.0,
        "return": pytest.approx(10.6),
        "num_actions": 4.0,
        "action_is_valid": 0.75,
        "action_is_effective": 0.5,
    }
    # The same record as one dict of per-turn arrays (as a batched rollout keeps it).
    columns = {key: np.array([i[key] for i in infos]) for key in infos[0]}
    assert episode_metrics(np.array(rewards), columns) == metrics


def test_failed_and_empty_episodes():
    metrics = episode_metrics([0.0, 0.0], [info(True, True), info(True, False)])
    assert metrics["success"] == 0.0 and metrics["action_is_effective"] == 0.5
    empty = episode_metrics([], [])
    assert empty == {"success": 0.0, "return": 0.0, "num_actions": 0.0,
                     "action_is_valid": 0.0, "action_is_effective": 0.0}
    with pytest.raises(ValueError, match="2 rewards but 1 values"):
        episode_metrics([0.0, 1.0], [info(True, True)])
