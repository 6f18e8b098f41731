"""scripts/analysis/sokoban_failures.py: board reading, the replay rule and the move verdicts."""

import jax
import numpy as np
import pytest

from jaxrl_agentic.envs import make
from tests.conftest import load_script
from tests.envs.solvers import parse_sokoban
from tests.envs.test_sokoban import board_of

UP, DOWN, LEFT, RIGHT = 0, 1, 2, 3
# The box is one push (Down) from its target.
ONE_PUSH = "\n".join(["######", "#_P__#", "#_X__#", "#_O__#", "#____#", "######"])
# A push Up puts the box against the top wall, away from its target's row: unsolvable.
NEAR_WALL = "\n".join(["######", "#____#", "#_X__#", "#_P__#", "#___O#", "######"])


@pytest.fixture(scope="module")
def failures():
    return load_script("scripts/analysis/sokoban_failures.py")


def test_last_board_reads_the_latest_board_of_a_prompt(failures):
    first = "\n".join(" ".join(row) for row in ONE_PUSH.split("\n"))
    later = "\n".join(" ".join(row) for row in NEAR_WALL.split("\n"))
    prompt = (f"Push the box X onto the target O.\n{first}\nBox: Down. Target: Down.\n"
              f"<answer>Left</answer>\n{later}\nBox: Up. Target: Down Right.")
    assert failures.last_board(prompt) == NEAR_WALL
    with pytest.raises(ValueError, match="no Sokoban board"):
        failures.last_board("Reply <answer>ACTION</answer>.")


def test_verdicts_on_hand_made_episodes(failures):
    judge = failures.judge_episode
    # One push solves it.
    assert judge(ONE_PUSH, [DOWN], 10) == {"start_distance": 1, "moves": ["optimal"],
                                           "cause": "solved"}
    # Left walks away from the push position (d 1 → 2), Up then bumps the top wall twice.
    episode = judge(ONE_PUSH, [LEFT, UP, UP], 10)
    assert episode["moves"] == ["detour", "bump", "bump"] and episode["cause"] == "stuck"
    # Up pushes the box against the wall for good; the bumps after it do not hide that.
    episode = judge(NEAR_WALL, [UP, UP, -1], 10)
    assert episode["moves"] == ["deadlock", "bump", "invalid"]
    assert episode["cause"] == "deadlock"
    # Right then Left: back where it started.
    assert judge(NEAR_WALL, [RIGHT, LEFT, DOWN], 10)["cause"] == "circles"
    # Right: a walk that keeps the level solvable; then the turns run out.
    episode = judge(NEAR_WALL, [RIGHT, DOWN], 10)
    assert episode["cause"] == "out_of_turns" and "deadlock" not in episode["moves"]
    # The box needs 2 pushes Down and 2 Right, and the player must walk round it: no policy
    # solves it in 3 turns.
    assert episode["start_distance"] > 3
    assert judge(NEAR_WALL, [RIGHT, DOWN], 3)["cause"] == "too_long"


def test_summary_counts(failures):
    episodes = [failures.judge_episode(ONE_PUSH, [DOWN], 10),
                failures.judge_episode(NEAR_WALL, [UP, UP], 10)]
    summary = failures.summarize(episodes)
    assert summary["success"] == 0.5 and summary["num_moves"] == 3
    assert summary["causes"] == {"deadlock": 1, "solved": 1}
    assert summary["moves"] == {"bump": round(1 / 3, 3), "deadlock": round(1 / 3, 3),
                                "optimal": round(1 / 3, 3)}
    assert summary["success_by_start_distance"]["<=2"] == {"levels": 1, "solved": 1}
    assert summary["moves_by_turn"][2] == {"bump": 1}


def test_replay_rule_matches_the_environment_on_generated_levels(failures):
    env, params = make("sokoban")
    step = jax.jit(env.step_env)
    keys = jax.random.split(jax.random.PRNGKey(3), 6)
    rng = np.random.default_rng(0)
    for key in keys:
        _, state = env.reset_env(key, params)
        position = parse_sokoban(board_of(state))
        for action in rng.integers(0, 4, size=12):
            _, state, _, _, _ = step(key, state, int(action), params)
            position = failures.move(position, failures.ACTION_NAMES[int(action)])
            assert position == parse_sokoban(board_of(state))
