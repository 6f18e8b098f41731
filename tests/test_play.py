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
    from jaxrl_agentic.rollout.groups import EpisodeSpec

    env = make_python_env("calculator")(EpisodeSpec(4, 0, 0), 0)
    first = env.reset(4)
    call = CalculatorOracle("compact").reply(first)  # what a person types: one line
    stdin = io.StringIO(call + "\n" + str(env.answer) + "\n")  # a bare line is an answer
    out = io.StringIO()
    assert main(["--env", "calculator", "--seed", "4"], stdin=stdin, stdout=out) == 0
    text = out.getvalue()
    assert '"name": "calculate"' in text and f"<tool_response>\n{env.answer}\n" in text
    assert "success=1" in text and "tool/calls=1" in text and "tool/errors=0" in text


def recipe_first_prompt(recipe: str, seed: int) -> str:
    """What the recipe's training rollout would show on the first turn of episode `seed`."""
    import os

    from jaxrl_agentic.envs.messages import first_message
    from jaxrl_agentic.train import parse_config

    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    c = parse_config(["play", f"--config={os.path.join(root, 'configs', recipe)}"])
    spec = next(iter(c.custom_envs.values()))
    env, params = make(spec.env_type, format_penalty=spec.format_penalty,
                       **dict(spec.env_config))
    _, reset_key = jax.random.split(jax.random.key(seed))  # play_episode's reset key
    _, state = env.reset(reset_key, params)
    return first_message(env, state, params)


@pytest.mark.parametrize("config", [None, "configs/frozen_lake.py"])
def test_a_model_plays_with_the_recipes_prompts_and_reply_format(tiny_model_dir, config):
    import os

    from jaxrl_agentic import play
    from jaxrl_agentic.envs.messages import first_message

    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    argv = ["--model", tiny_model_dir, "--max-turns", "1", "--seed", "3"]
    if config:  # without it, --model means the default recipe (what train runs)
        argv += ["--config", os.path.join(root, config)]
    out = io.StringIO()
    assert play.main(argv, stdin=io.StringIO(""), stdout=out) == 0
    text = out.getvalue()
    want = recipe_first_prompt("frozen_lake.py", 3)
    default_env, default_params = make("frozen_lake")
    assert f"--- turn 1 ---\n{want}\n" in text
    # The recipe's prompt is not the env's default one (brief instructions, hints).
    _, state = default_env.reset(jax.random.split(jax.random.key(3))[1], default_params)
    assert first_message(default_env, state, default_params) != want
    # The recipe's reply format: "<answer>" + one generated token + "</answer>".
    reply = [line for line in text.splitlines() if line.startswith("model: ")][0]
    assert reply.startswith("model: <answer>") and reply.endswith("</answer>")


def test_play_config_with_an_unknown_env_tag_is_a_usage_error(capsys):
    import os

    from jaxrl_agentic import play

    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    with pytest.raises(SystemExit) as e:
        play.main(["--config", os.path.join(root, "configs", "sokoban.py"), "--env", "lake"],
                  stdin=io.StringIO(""), stdout=io.StringIO())
    assert e.value.code == 2
    assert "--env 'lake' is not an env tag of" in capsys.readouterr().err


def test_an_environment_of_ones_own_without_its_recipe_says_to_pass_config():
    # docs/examples/custom_environment.py registers `guess_the_number` when it is loaded;
    # without --config the name is unknown, and the error says what to pass.
    err = io.StringIO()
    with pytest.raises(SystemExit) as exit_info, contextlib.redirect_stderr(err):
        main(["--env", "guess_the_number_not_loaded"], stdin=io.StringIO(),
             stdout=io.StringIO())
    last = err.getvalue().strip().splitlines()[-1]
    assert exit_info.value.code == 2
    assert "unknown environment 'guess_the_number_not_loaded'" in last
    assert "needs --config <recipe>" in last


def test_an_environment_of_ones_own_plays_with_its_recipe():
    import os

    recipe = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))),
                          "docs", "examples", "custom_environment.py")
    text = run(["--config", recipe, "--env", "guess"], "9\n")
    assert "Guess the number from 1 to 8" in text and "reward: -0.1  done: False" in text
