import contextlib
import io

import jax
import pytest

from jaxrl_agentic.envs import make
from jaxrl_agentic.play import main, play_episode
from tests.envs.solvers import frozen_lake_path, parse_sokoban, sokoban_path


def run(argv, typed: str) -> str:
    out = io.StringIO()
    assert main(argv, stdin=io.StringIO(typed), stdout=out) == 0
    return out.getvalue()


def test_typed_replies_are_parsed_penalised_and_summed_up():
    text = run(["--env", "frozen_lake", "--seed", "0"],
               "nonsense\n<think>hmm</think><answer>Jump</answer>\nLEFT\n")
    assert text.startswith("--- turn 1 ---\nYou are on a frozen lake.")
    assert "Actions: Left, Down, Right, Up" in text
    assert text.count("action: none (no valid action: format penalty)") == 2
    assert text.count("reward: -0.1  done: False") == 2
    assert "action: Left\n" in text  # a bare name is wrapped in answer tags
    last = text.rstrip("\n").split("\n")[-1]
    assert last.startswith("metrics: success=")
    assert "return=-0.2 num_actions=3 action_is_valid=0.333333" in last


def test_end_of_input_and_max_turns_end_the_episode_cleanly():
    text = run(["--env", "sokoban", "--seed", "3"], "")
    assert "(end of input)" in text and text.endswith(
        "metrics: success=0 return=0 num_actions=0 action_is_valid=0 action_is_effective=0\n"
    )
    text = run(["--env", "sokoban", "--max-turns", "1"], "up\nup\nup\n")
    assert text.count("--- turn") == 1 and "num_actions=1 " in text


def test_unknown_env_is_a_usage_error():
    err = io.StringIO()
    with pytest.raises(SystemExit) as exit_info, contextlib.redirect_stderr(err):
        main(["--env", "nope"], stdin=io.StringIO(), stdout=io.StringIO())
    assert exit_info.value.code == 2 and "unknown environment 'nope'" in err.getvalue()


def board_in(prompt: str) -> str:
    """The grid: the trailing lines of the message (grid rows hold no spaces)."""
    lines = prompt.split("\n")
    start = len(lines)
    while start > 0 and " " not in lines[start - 1]:
        start -= 1
    return "\n".join(lines[start:])


def frozen_lake_policy(prompt: str) -> str:
    return f"<think>shortest path</think><answer>{frozen_lake_path(board_in(prompt))[0]}</answer>"


def sokoban_policy(prompt: str) -> str:
    return f"<answer>{sokoban_path(*parse_sokoban(board_in(prompt)))[0]}</answer>"


@pytest.mark.parametrize("name, policy", [("frozen_lake", frozen_lake_policy),
                                          ("sokoban", sokoban_policy)])
def test_a_solver_policy_reading_the_text_wins_every_episode(name, policy):
    env, params = make(name)
    for seed in range(3):
        out = io.StringIO()
        metrics = play_episode(env, params, policy, jax.random.key(seed), out)
        assert metrics["success"] == 1.0 and metrics["action_is_valid"] == 1.0
        assert "--- final state ---" in out.getvalue()
        if name == "frozen_lake":
            assert metrics["return"] == 1.0
            assert "√" in out.getvalue().split("--- final state ---")[1]
        else:
            assert metrics["return"] == pytest.approx(10 + 1 - 0.1 * metrics["num_actions"])


def test_play_with_a_model_prints_its_replies(tiny_model_dir):
    import io

    from jaxrl_agentic import play

    out = io.StringIO()
    status = play.main(["--env", "frozen_lake", "--model", tiny_model_dir, "--max-turns", "2",
                        "--max-new-tokens", "6", "--seed", "3"], stdin=io.StringIO(""),
                       stdout=out)
    text = out.getvalue()
    assert status == 0
    assert text.count("model: ") == 2 and text.count("--- turn") == 2
    assert "metrics: " in text


def test_play_with_a_missing_model_is_one_line_error(capsys):
    import io

    import pytest

    from jaxrl_agentic import play

    with pytest.raises(SystemExit) as e:
        play.main(["--model", "/nonexistent/dir"], stdin=io.StringIO(""), stdout=io.StringIO())
    assert e.value.code == 2
    assert "model directory not found: /nonexistent/dir" in capsys.readouterr().err


def test_a_person_can_play_the_calculator_with_typed_tool_calls():
    import io

    from jaxrl_agentic.envs.calculator import CalculatorOracle
    from jaxrl_agentic.envs.python_env import make_python_env
    from jaxrl_agentic.play import main
    from jaxrl_agentic.rollout.loop import EpisodeSpec

    env = make_python_env("calculator")(EpisodeSpec(4, 0, 0), 0)
    first = env.reset(4)
    call = CalculatorOracle().reply(first)  # what a person would type
    stdin = io.StringIO(call + "\n" + str(env.answer) + "\n")  # a bare line is an answer
    out = io.StringIO()
    assert main(["--env", "calculator", "--seed", "4"], stdin=stdin, stdout=out) == 0
    text = out.getvalue()
    assert '"name": "calculate"' in text and f"<tool_response>\n{env.answer}\n" in text
    assert "success=1" in text and "tool/calls=1" in text and "tool/errors=0" in text
