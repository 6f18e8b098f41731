"""`textarena:<id>`: scripted episodes against the same game driven through TextArena's own
API (`textarena.make(id)`, its default `LLMObservationWrapper` view), seeds, invalid moves,
id and config checks."""

import random
import re
import sys
from collections import deque

import numpy as np
import pytest
import textarena as ta

import jaxrl_agentic.envs.textarena_env as T
from jaxrl_agentic.envs.python_env import make_python_env, text_state_hash
from jaxrl_agentic.rollout.groups import EpisodeSpec


def episode(env_id, seed=0, **config):
    factory = make_python_env(f"textarena:{env_id}", **config)
    return factory(EpisodeSpec(seed=seed, group_id=0, member=0), 0)


class RawGame:
    """The reference: a TextArena env as TextArena plays it, whose observation is the whole
    history; `new()` is what was added since the last call."""

    def __init__(self, env_id, seed):
        self.env = ta.make(env_id)
        self.env.reset(num_players=1, seed=seed)
        self.seen = ""

    def new(self):
        _, full = self.env.get_observation()
        assert full.startswith(self.seen)
        added, self.seen = full[len(self.seen):], full
        return added

    def step(self, action):
        done, _ = self.env.step(action)
        added = self.new()
        rewards, game_info = self.env.close() if done else (None, None)
        return done, added, rewards, game_info


def check_against_raw(env_id, seed, replies):
    """Plays `replies` on both; returns the adapter's steps."""
    env, raw = episode(env_id, seed=seed), RawGame(env_id, seed)
    assert "\n" + env.reset(seed) == raw.new()
    steps = []
    for reply in replies:
        step = env.step(reply)
        steps.append(step)
        done, added, rewards, game_info = raw.step(reply)
        # TextArena's new text: the echo of the (bracketed) action, then the game's messages.
        echo, _, rest = added[1:].partition("\n")
        assert re.fullmatch(r"\[(GAME|Player)\] .*", echo) and reply.strip("[]") in echo
        assert step.terminated == done
        if done:
            assert step.observation == (rest + "\n" if rest else "") + \
                f"[GAME] {game_info[0]['reason']}"
            assert step.reward == pytest.approx(rewards[0])
            assert step.action_is_valid == (not game_info[0]["invalid_move"])
            break
        assert step.observation == rest
    return steps


def frozen_lake_path(board_text):
    """Moves from P to G avoiding holes (BFS over the rendered board)."""
    rows = [r for r in board_text.splitlines() if r.startswith("|")]
    grid = [[c.strip() for c in r.strip("|").split("|")] for r in rows]
    cells = {(i, j): c for i, row in enumerate(grid) for j, c in enumerate(row)}
    start = next(p for p, c in cells.items() if c == "P")
    moves = {"up": (-1, 0), "down": (1, 0), "left": (0, -1), "right": (0, 1)}
    prev, queue = {start: None}, deque([start])
    while queue:
        p = queue.popleft()
        if cells[p] == "G":
            path = []
            while prev[p] is not None:
                p, move = prev[p]
                path.append(move)
            return path[::-1]
        for name, (di, dj) in moves.items():
            q = (p[0] + di, p[1] + dj)
            if q in cells and q not in prev and cells[q] != "H":
                prev[q] = (p, name)
                queue.append(q)
    raise AssertionError("no path")


HANOI_3 = ["[A C]", "[A B]", "[C B]", "[A C]", "[B A]", "[B C]", "[A C]"]


def test_tower_of_hanoi_matches_textarena_and_is_solved():
    # An invalid move (disk 2 onto disk 1), forgiven; a reply without brackets, which the
    # id's action wrapper brackets; then the optimal solution.
    replies = ["[A C]", "[A C]", "A B"] + HANOI_3[2:]
    steps = check_against_raw("TowerOfHanoi-v0", 0, replies)
    assert [s.action_is_valid for s in steps] == [True, False] + [True] * 6
    assert steps[1].reward == pytest.approx(-0.1) and not steps[1].terminated
    assert [s.reward for s in steps[:-1]] == [0.0, -0.1] + [0.0] * 5
    last = steps[-1]
    assert last.terminated and last.success and last.reward == 1.0
    assert "Congratulations" in last.observation


def test_frozen_lake_bfs_path_matches_textarena_and_wins():
    seed = 3
    first = episode("FrozenLake-v0", seed=seed).reset(seed)
    path = ["[up]"] + [f"[{m}]" for m in frozen_lake_path(first)]  # up: a wall, forgiven
    steps = check_against_raw("FrozenLake-v0", seed, path)
    assert not steps[0].action_is_valid and not steps[0].terminated
    assert all(s.action_is_valid for s in steps[1:])
    assert steps[-1].terminated and steps[-1].success and steps[-1].reward == 1.0


def test_guess_the_number_binary_search_matches_textarena():
    seed, env = 11, episode("GuessTheNumber-v0", seed=11)
    env.reset(seed)
    lo, hi, replies = 1, 20, []
    for _ in range(10):
        guess = (lo + hi) // 2
        replies.append(f"I guess [{guess}]")
        step = env.step(replies[-1])
        if step.terminated:
            break
        if "higher" in step.observation:
            lo = guess + 1
        else:
            assert "lower" in step.observation
            hi = guess - 1
    assert step.success and step.reward == 1.0
    steps = check_against_raw("GuessTheNumber-v0", seed, ["no guess here"] + replies)
    assert not steps[0].action_is_valid and steps[-1].success


def test_second_invalid_move_in_a_row_ends_the_game_as_textarena_decides():
    steps = check_against_raw("FrozenLake-v0", 0, ["[up]", "[left]"])
    assert [s.action_is_valid for s in steps] == [False, False]
    assert [s.terminated for s in steps] == [False, True]
    assert not steps[1].success and "Invalid Move" in steps[1].observation
    env = episode("FrozenLake-v0")
    with pytest.raises(RuntimeError, match="before reset"):
        env.step("[down]")
    env.reset(0)
    env.step("[up]")
    assert env.step("[left]").terminated
    with pytest.raises(RuntimeError, match="ended"):
        env.step("[down]")


def test_minesweeper_matches_textarena():
    # Mines are placed at the first reveal, from the global `random` during a step.
    steps = check_against_raw("Minesweeper-v0", 5, ["[3 3]", "[3 3]", "[0 0]", "[7 7]"])
    assert [s.action_is_valid for s in steps[:3]] == [True, False, True]


def test_same_seed_same_game_other_seeds_other_games():
    firsts = [episode("FrozenLake-v0").reset(s) for s in range(6)]
    assert episode("FrozenLake-v0").reset(2) == firsts[2]
    assert len(set(firsts)) >= 3
    # The hidden number: the same replies get the same answers on the same seed only.
    def answers(seed):
        env = episode("GuessTheNumber-v0")
        env.reset(seed)
        out = []
        for guess in (5, 10, 15):
            out.append(env.step(f"[{guess}]").observation)
            if "Congratulations" in out[-1]:
                break
        return out
    assert answers(4) == answers(4)
    assert len({tuple(answers(s)) for s in range(6)}) >= 2


def test_episodes_keep_their_own_random_stream_and_leave_the_global_one():
    # 2048 spawns a tile from `random` after every move: interleaving another episode and
    # other uses of `random` must not change either game.
    moves = ["[up]", "[left]", "[down]", "[right]"] * 3
    solo = episode("2048-v0")
    solo_obs = [solo.reset(7)] + [solo.step(m).observation for m in moves]
    a, b = episode("2048-v0"), episode("2048-v0")
    state = random.getstate()
    obs_a, obs_b = [a.reset(7)], [b.reset(8)]
    for m in moves:
        random.random()
        np.random.rand()
        obs_a.append(a.step(m).observation)
        obs_b.append(b.step(m).observation)
    assert obs_a == solo_obs and obs_b != obs_a
    random.random()  # the global stream went on as if no game had used it
    expected = random.Random()
    expected.setstate(state)
    for _ in range(len(moves)):
        expected.random()
    expected.random()
    assert random.random() == expected.random()


def test_state_hash_is_the_current_message():
    env = episode("TowerOfHanoi-v0")
    with pytest.raises(RuntimeError):
        env.state_hash()
    first = env.reset(0)
    assert env.state_hash() == text_state_hash(first)
    step = env.step("[A C]")
    assert env.state_hash() == text_state_hash(step.observation) != text_state_hash(first)


def test_unknown_id_names_close_matches():
    with pytest.raises(ValueError, match="FrozenLake-v0"):
        make_python_env("textarena:FrozenLake-v1")
    with pytest.raises(ValueError, match="TowerOfHanoi-v0"):
        make_python_env("textarena:TowerOfHanoy-v0")
    with pytest.raises(ValueError, match="unknown TextArena"):
        make_python_env("textarena:NoSuchGame")


@pytest.mark.parametrize("env_id, message", [
    ("Wordle-v0", "needs the network"), ("Hangman-v0-raw", "needs the network"),
    ("TwentyQuestions-v0", "needs the network"),
    ("ThreePlayerTicTacToe-v0", "neither a single-player nor a two-player"),
    ("Klondike-v0", "does not compile"),
])
def test_ids_that_cannot_run_here_are_refused(env_id, message):
    with pytest.raises(ValueError, match=message):
        make_python_env(f"textarena:{env_id}")
    assert env_id not in T.offline_ids()


def test_offline_ids():
    ids = T.offline_ids()
    for env_id in ("FrozenLake-v0", "GuessTheNumber-v0", "TowerOfHanoi-v0", "Minesweeper-v0",
                   "Mastermind-v0", "Sokoban-v0", "2048-v0", "TowerOfHanoi-v0-raw"):
        assert env_id in ids
    assert set(ids) < set(T.single_player_ids())


def test_config():
    with pytest.raises(ValueError, match="unknown config"):
        make_python_env("textarena:FrozenLake-v0", is_slippery=True)
    with pytest.raises(ValueError, match="format_penalty"):
        make_python_env("textarena:FrozenLake-v0", format_penalty=-1.0)
    with pytest.raises(ValueError, match="max_steps_in_episode"):
        make_python_env("textarena:FrozenLake-v0", max_steps_in_episode=0)
    with pytest.raises(ValueError, match="does not start"):
        make_python_env("textarena:FrozenLake-v0", game_kwargs={"no_such_arg": 1})
    with pytest.raises(ValueError, match="game_kwargs must be a dict"):
        make_python_env("textarena:FrozenLake-v0", game_kwargs=3)
    assert T.textarena_limits("TowerOfHanoi-v0") == {
        "max_turns": 14, "error_allowance": 1, "max_reply_chars": None,
        "max_reply_words": None}
    assert T.textarena_limits("2048-v0")["max_turns"] is None
    assert episode("TowerOfHanoi-v0").max_steps_in_episode == 28  # 14 turns, 1 retry each
    assert episode("2048-v0").max_steps_in_episode == T.DEFAULT_MAX_STEPS
    env = episode("GuessTheNumber-v0", max_steps_in_episode=5, format_penalty=0.0,
                  reply_hint="Reply with your guess in brackets.",
                  game_kwargs={"max_number": 5})
    first = env.reset(0)
    assert env.max_steps_in_episode == 5
    assert "between 1 and 5" in first
    assert first.endswith("\nReply with your guess in brackets.")
    assert env.step("[x]").reward == 0.0


def test_missing_textarena_is_an_import_error(monkeypatch):
    monkeypatch.setitem(sys.modules, "textarena", None)
    with pytest.raises(ImportError, match=r"textarena:FrozenLake-v0 needs the textarena "
                                          r"package: pip install -e '\.\[envs\]'"):
        make_python_env("textarena:FrozenLake-v0")


def test_concurrent_episodes_equal_solo_ones():
    # Minesweeper places its mines from `random` at the first reveal, 2048 a tile per move;
    # a tiny switch interval makes the threads interleave inside the games' calls.
    from concurrent.futures import ThreadPoolExecutor

    def play(job):
        env_id, seed = job
        env = episode(env_id)
        out = [env.reset(seed)]
        for move in ["[3 3]", "[0 0]", "[7 0]", "[0 7]"] if env_id.startswith("Mine") \
                else ["[up]", "[left]", "[down]", "[right]"] * 2:
            step = env.step(move)
            out.append(step.observation)
            if step.terminated:
                break
        return out

    jobs = [(g, s) for g in ("Minesweeper-v0", "2048-v0") for s in range(6)] * 2
    solo = [play(j) for j in jobs]
    interval = sys.getswitchinterval()
    sys.setswitchinterval(1e-6)
    try:
        with ThreadPoolExecutor(8) as pool:
            threaded = list(pool.map(play, jobs))
    finally:
        sys.setswitchinterval(interval)
    assert threaded == solo


def test_runner_plays_frozen_lake_episodes(tiny_model_dir):
    import transformers

    from jaxrl_agentic.rollout.conversation import ChatFormatter
    from jaxrl_agentic.rollout.python_runner import PythonRolloutRunner
    from jaxrl_agentic.rollout.turns import GenerationConfig
    from jaxrl_agentic.warmup import ScriptedSampler, text_policy_replies

    formatter = ChatFormatter(transformers.AutoTokenizer.from_pretrained(tiny_model_dir))
    # Each new message shows the board: the policy walks the first step of a shortest path.
    def first_move(text):
        return f"[{frozen_lake_path(text)[0]}]"

    replies = text_policy_replies(formatter, lambda rng: first_move, seed=0)
    runner = PythonRolloutRunner(make_python_env("textarena:FrozenLake-v0"),
                                 ScriptedSampler(replies, max_total_len=8192), formatter,
                                 tag="lake", max_turns=12, max_input_length=6000,
                                 generation=GenerationConfig(max_tokens_per_step=32))
    trajs = runner.run([EpisodeSpec(seed=s, group_id=s, member=0) for s in range(6)],
                       sample_seed=0)
    for traj in trajs:
        assert traj.terminated and traj.metrics["success"] == 1.0
        assert [t.reward for t in traj.turns][-1] == 1.0


def test_games_that_swap_textarenas_arguments():
    # Cryptarithm-v0 (like Countdown-v0 and Slitherlink-v0) logs the action with swapped
    # arguments and passes set_invalid_move (progress, reason): the echo is still dropped,
    # and the game ended on an invalid move gets its progress as reward.
    env = episode("Cryptarithm-v0")
    env.reset(0)
    steps = [env.step(r) for r in ("[S 9]", "x", "y")]
    assert all("ObservationType" not in s.observation for s in steps)
    assert [s.action_is_valid for s in steps] == [True, False, False]
    assert steps[-1].terminated and not steps[-1].success
    assert steps[-1].reward == pytest.approx(1 / 8)  # S of SEND+MORE=MONEY's 8 letters
    assert "Bad action format" in steps[-1].observation


def _lake_runner(factory, tokenizer_dir, **kwargs):
    import transformers

    from jaxrl_agentic.rollout.conversation import ChatFormatter
    from jaxrl_agentic.rollout.python_runner import PythonRolloutRunner
    from jaxrl_agentic.rollout.turns import GenerationConfig
    from jaxrl_agentic.warmup import ScriptedSampler, text_policy_replies

    formatter = ChatFormatter(transformers.AutoTokenizer.from_pretrained(tokenizer_dir))

    def first_move(text):  # each new message shows the board: one step of a shortest path
        return f"[{frozen_lake_path(text)[0]}]"

    replies = text_policy_replies(formatter, lambda rng: first_move, seed=0)
    runner = PythonRolloutRunner(factory, ScriptedSampler(replies, max_total_len=8192),
                                 formatter, tag="lake", max_turns=12,
                                 generation=GenerationConfig(max_tokens_per_step=32),
                                 **{"max_input_length": 6000, **kwargs})
    return runner, formatter


def test_faults_inside_the_game_end_only_their_episode_and_are_counted(tiny_model_dir):
    """TextArena's own step raising, hanging past `step_timeout_s`, and answering with text
    too long for the context: each ends its episode, counted as `env/errors`,
    `env/timeouts` and `env/truncated_by_length`; the fourth episode of the batch plays as
    it does alone."""
    import threading

    from jaxrl_agentic.pipeline.metrics import trajectory_metrics

    base = make_python_env("textarena:FrozenLake-v0")
    release = threading.Event()

    def factory(spec, run_seed):
        env = base(spec, run_seed)
        reset = env.reset

        def faulty_reset(seed):  # the game object exists from reset on; break its step
            text = reset(seed)
            step = env.game.step
            if spec.group_id == 0:
                def raising(action):
                    raise ConnectionError("game server went away")
                env.game.step = raising
            elif spec.group_id == 1:
                def hanging(action):
                    release.wait(120)
                    return step(action)
                env.game.step = hanging
            elif spec.group_id == 2:
                observation = env.base.get_observation

                def flooding(action):
                    out = step(action)
                    pid, messages = observation()
                    env.base.get_observation = lambda: (pid, messages + [
                        (-1, "x " * 8000, None)])
                    return out
                env.game.step = flooding
            return text

        env.reset = faulty_reset
        return env

    runner, _ = _lake_runner(factory, tiny_model_dir, step_timeout_s=1.0,
                             max_input_length=3000)
    plan = [EpisodeSpec(seed=7, group_id=g, member=0) for g in range(4)]
    try:
        trajs = runner.run(plan, sample_seed=0)
    finally:
        release.set()
    raised, hung, flooded, fine = trajs
    for t in (raised, hung):  # the reply that met the fault stays, as a turn worth 0
        assert t.truncated and len(t.turns) == 1 and t.turns[0].reward == 0.0
    assert flooded.truncated_by_length and len(flooded.turns) == 1
    metrics = trajectory_metrics(trajs, "env/")
    assert (metrics["env/errors"], metrics["env/timeouts"],
            metrics["env/truncated_by_length"]) == (0.25, 0.25, 0.25)
    alone, _ = _lake_runner(base, tiny_model_dir, max_input_length=3000)
    (reference,) = alone.run([EpisodeSpec(seed=7, group_id=3, member=0)], sample_seed=0)
    assert fine.tokens == reference.tokens and fine.metrics["success"] == 1.0


def test_the_token_stream_is_the_chat_rendered_at_once(tiny_model_dir):
    """A TextArena episode's stream equals its messages (the game's texts as user turns,
    the replies as assistant turns) rendered by the chat template in one go."""
    runner, formatter = _lake_runner(make_python_env("textarena:FrozenLake-v0"),
                                     tiny_model_dir)
    (t,) = runner.run([EpisodeSpec(seed=3, group_id=0, member=0)], sample_seed=0)
    assert t.terminated and len(t.turns) >= 3
    env = episode("FrozenLake-v0", seed=3)
    messages = [{"role": "user", "content": env.reset(3)}]
    for turn in t.turns:
        messages.append({"role": "assistant", "content": turn.reply})
        step = env.step(turn.reply)
        if not step.terminated:
            messages.append({"role": "user", "content": step.observation})
    tok = formatter.tokenizer
    text = tok.apply_chat_template(messages, tokenize=False)
    assert text.endswith(tok.eos_token + "\n")
    assert t.tokens == tok.encode(text[:-1], add_special_tokens=False)


@pytest.mark.parametrize("env_id, allowed", [
    ("FrozenLake-v0", {"[up]", "[down]", "[left]", "[right]", "[w]", "[a]", "[s]", "[d]"}),
    ("TowerOfHanoi-v0", {"[A C]"}),
    ("Minesweeper-v0", {"[row col]", "[3 2]", "[5 6]"}),
])
def test_the_warm_up_policy_replies_with_the_games_example_actions(env_id, allowed):
    env = episode(env_id, seed=1)
    reply = T.random_example_policy(random.Random(0))
    first = env.reset(1)
    replies = [reply(first)] + [reply("[GAME] Current Board:") for _ in range(40)]
    assert set(replies) == allowed  # every example drawn, nothing else ([GAME] is a tag)
    if env_id == "FrozenLake-v0":
        assert env.step(replies[0]).action_is_valid
