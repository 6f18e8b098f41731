"""Multi-seat rollouts (`rollout/seats.py`) with a scripted policy: each policy seat is its
own token stream and trajectory, checked against the game replayed through
`TextArenaMatch` and the formatter; both seats decode in the same sampler calls; per-seat
baselines; random seats give no trajectory."""

import random

import numpy as np
import pytest

from jaxrl_agentic.algos.estimators import turn_advantages
from jaxrl_agentic.envs import textarena_games as G
from jaxrl_agentic.envs.python_env import make_python_env
from jaxrl_agentic.models import load_pretrained
from jaxrl_agentic.pipeline.metrics import trajectory_metrics
from jaxrl_agentic.rollout.conversation import ChatFormatter
from jaxrl_agentic.rollout.groups import EpisodeSpec
from jaxrl_agentic.rollout.runner import make_runner
from jaxrl_agentic.rollout.seats import SEAT_ID_STRIDE, SeatRolloutRunner
from jaxrl_agentic.rollout.turns import GenerationConfig, turn_seed
from jaxrl_agentic.sampling import GenerationResult
from jaxrl_agentic.warmup import ScriptedSampler, _ScriptedSession

MAX_INPUT = 4000


@pytest.fixture(scope="module")
def formatter(tiny_model_dir):
    _, tok = load_pretrained(tiny_model_dir)
    return ChatFormatter(tok)


class RecordingSampler(ScriptedSampler):
    """A scripted policy keyed like the sampler's noise: row r of a call with `seed` replies
    with a move listed in its newest messages (an unlisted one with probability `invalid`),
    drawn with Random((seed, row_seeds[r])); records each call's rows, seed and row seeds."""

    def __init__(self, formatter, invalid=0.0, seed=0):
        self.calls, self.formatter, self.invalid, self.seed = [], formatter, invalid, seed
        super().__init__(None, max_total_len=MAX_INPUT + 9)

    def reply(self, new_ids, seed, row_seed):
        rng = random.Random(f"{self.seed}/{seed}/{row_seed}")
        text = self.formatter.tokenizer.decode(new_ids, skip_special_tokens=True)
        moves = G.listed_moves(text)
        move = rng.choice(moves) if moves and rng.random() >= self.invalid else "[9]"
        return self.formatter.reply_ids(move)

    def new_session(self, num_rows):
        sampler = self

        class Session(_ScriptedSession):
            def generate(self, rows, *, seed, row_seeds, **kwargs):
                row_seeds = [row_seeds[r] for r in rows]
                sampler.calls.append((list(rows), seed, row_seeds))
                tokens = [sampler.reply(self.new_ids.pop(r, []), seed, rs)
                          for r, rs in zip(rows, row_seeds, strict=True)]
                return GenerationResult(tokens=tokens,
                                        logprobs=[np.zeros(len(t), np.float32)
                                                  for t in tokens],
                                        stop_reasons=["eos"] * len(tokens))

        return Session(self)


def runner(formatter, sampler, env_config=None, max_turns=10, max_input_length=MAX_INPUT,
           env="textarena:TicTacToe-v0"):
    return make_runner(env, dict(env_config or {}), sampler, formatter, tag="game",
                       max_turns=max_turns, max_input_length=max_input_length,
                       generation=GenerationConfig(max_tokens_per_step=8), format_penalty=0.1)


def games(n, group_size=1):
    return [EpisodeSpec(seed=2 * g, group_id=g, member=m) for g in range(n)
            for m in range(group_size)]


def replay(formatter, spec, seat_trajs, config=None):
    """The game of `spec` replayed through TextArenaMatch with the recorded replies: → the
    token stream each policy seat should have, and the game's rewards."""
    match = make_python_env("textarena:TicTacToe-v0", **(config or {}))(spec, 0)
    match.start(spec.seed)
    streams = {seat: [] for seat in seat_trajs}
    turn = dict.fromkeys(seat_trajs, 0)
    while not match.done:
        seat = match.current_seat
        text = match.observe()
        if streams[seat]:
            streams[seat] += formatter.next_prompt(text)
        else:
            streams[seat] += formatter.first_prompt(text)
        u = seat_trajs[seat].turns[turn[seat]]
        streams[seat] += u.generated + ([formatter.eos_token_id] if u.eos_appended else [])
        match.move(u.reply)
        turn[seat] += 1
    return streams, match.rewards()


def test_runner_is_the_environments_own(formatter):
    assert isinstance(runner(formatter, RecordingSampler(formatter)), SeatRolloutRunner)


def test_self_play_streams_rewards_and_masks(formatter):
    sampler = RecordingSampler(formatter, invalid=0.25, seed=1)
    specs = games(6)
    trajs = runner(formatter, sampler).run(specs, sample_seed=5, traj_id_start=100)
    assert len(trajs) == 2 * len(specs)  # every seat of every game
    by = {(t.group_id, t.seat): t for t in trajs}
    invalid_seen = 0
    for spec in specs:
        seats = {s: by[spec.group_id, s] for s in (0, 1)}
        assert seats[0].traj_id == 100 + spec.group_id
        assert seats[1].traj_id == 100 + spec.group_id + SEAT_ID_STRIDE
        streams, rewards = replay(formatter, spec, seats)
        assert rewards[0] + rewards[1] == 0.0
        for seat, t in seats.items():
            assert t.tokens == streams[seat]  # its own conversation, exactly
            assert t.terminated and not t.truncated
            if t.turns:
                assert [u.reward for u in t.turns] == [0.0] * (len(t.turns) - 1) + [
                    rewards[seat]]
                assert t.score == rewards[seat]
            else:  # the other seat lost on invalid moves before this one moved: no sample
                assert t.tokens == [] and rewards[seat] == 1.0
            mask = t.loss_mask()
            assert mask.sum() == sum(len(u.generated) for u in t.turns)
            masked = [tok for tok, m in zip(t.tokens, mask, strict=True) if m]
            assert masked == [tok for u in t.turns for tok in u.generated]
            assert t.metrics["game/win"] == float(rewards[seat] > 0)
            invalid_seen += t.metrics["game/invalid_moves"]
            assert t.metrics["game/invalid_moves"] == sum(not u.action_is_valid
                                                           for u in t.turns)
    assert invalid_seen > 0  # the invalid-move path was played


def test_seats_decode_together_one_call_per_round(formatter):
    sampler = RecordingSampler(formatter, invalid=0.3, seed=2)
    trajs = runner(formatter, sampler).run(games(8), sample_seed=3)
    # One sampler call per round (every game's move of that round), not per seat or game.
    moves_per_game = {}
    for t in trajs:
        moves_per_game[t.group_id] = moves_per_game.get(t.group_id, 0) + len(t.turns)
    assert len(sampler.calls) == max(moves_per_game.values())
    assert sum(len(rows) for rows, _, _ in sampler.calls) == sum(moves_per_game.values())
    seat_of_row = {r: t.seat for r, t in enumerate(trajs)}
    # Forgiven invalid moves desynchronise the games: then both seats share a call.
    assert any(len({seat_of_row[r] for r in rows}) == 2 for rows, _, _ in sampler.calls)
    # Noise keys: round r's seed, the seat's trajectory id.
    for r, (rows, seed, row_seeds) in enumerate(sampler.calls):
        assert seed == turn_seed(3, r)
        assert row_seeds == [trajs[row].traj_id for row in rows]


def test_a_game_draws_the_same_noise_in_any_batch(formatter):
    """Round r of a game is its r-th policy move in any batch, so its noise keys (and, with
    a scripted policy, its trajectories) do not depend on the other games."""
    def played(specs, group, traj_id_start=0):
        sampler = RecordingSampler(formatter, seed=7)
        trajs = runner(formatter, sampler).run(specs, sample_seed=11,
                                               traj_id_start=traj_id_start)
        ids = {t.traj_id for t in trajs if t.group_id == group}
        keys = [(seed, rs) for _, seed, row_seeds in sampler.calls for rs in row_seeds
                if rs in ids]
        return keys, [t.tokens for t in trajs if t.group_id == group]

    alone = played([EpisodeSpec(seed=4, group_id=2, member=0)], 2, traj_id_start=2)
    assert played(games(5), 2) == alone


def test_per_seat_baselines(formatter):
    """GRPO normalises each seat against the same seat of its group's games."""
    sampler = RecordingSampler(formatter, seed=4)
    trajs = runner(formatter, sampler).run(games(4, group_size=4), sample_seed=0)
    advantages = turn_advantages(trajs, adv_estimator="grpo")
    for t, a in zip(trajs, advantages, strict=True):
        same = [u.score for u in trajs if (u.group_id, u.seat) == (t.group_id, t.seat)]
        assert len(same) == 4
        expected = (t.score - np.mean(same)) / (np.std(same, ddof=1) + 1e-6)
        np.testing.assert_allclose(a, expected, rtol=1e-4, atol=1e-5)
    # A seat that always wins against the other seat of its group has nothing to learn:
    # pooled with the other seat, a zero-sum game would give it +1 for every win.
    for t in (t for t in trajs if t.turns):
        t.turns[-1].reward = 1.0 if t.seat == 0 else -1.0
    assert all(np.all(a == 0) for a in turn_advantages(trajs, adv_estimator="grpo"))


def test_random_seats_give_no_trajectories_and_alternate(formatter):
    config = dict(seats=("policy", "random"), alternate_seats=True)
    sampler = RecordingSampler(formatter, seed=5)
    specs = games(6)
    trajs = runner(formatter, sampler, config).run(specs, sample_seed=0)
    assert len(trajs) == len(specs)
    assert [t.seat for t in sorted(trajs, key=lambda t: t.group_id)] == [0, 1, 0, 1, 0, 1]
    for t in trajs:
        spec = specs[t.group_id]
        streams, rewards = replay(formatter, spec, {t.seat: t}, config)
        assert t.tokens == streams[t.seat] and t.score == rewards[t.seat]
    metrics = trajectory_metrics(trajs, "eval/")
    wins = np.mean([t.score > 0 for t in trajs])
    assert metrics["eval/win_rate"] == pytest.approx(wins)
    assert metrics["eval/win_rate"] + metrics["eval/draw_rate"] + metrics["eval/loss_rate"] \
        == pytest.approx(1.0)
    assert {"eval/seat0/win_rate", "eval/seat1/win_rate", "eval/invalid_moves"} <= set(metrics)


def test_prompt_over_the_limit_cuts_the_game(formatter):
    sampler = RecordingSampler(formatter, seed=6)
    first = len(formatter.first_prompt(
        make_python_env("textarena:TicTacToe-v0")(games(1)[0], 0).reset(0)))
    trajs = runner(formatter, sampler, max_input_length=first + 200).run(games(2),
                                                                         sample_seed=0)
    assert any(t.truncated_by_length for t in trajs)
    for t in trajs:
        assert t.truncated and not t.terminated and t.score == 0.0
        assert len(t.tokens) <= first + 200 + 9
        assert t.metrics["game/ended"] == 0.0


def test_turn_limit_cuts_the_game(formatter):
    trajs = runner(formatter, RecordingSampler(formatter), max_turns=2).run(games(3),
                                                                           sample_seed=0)
    for t in trajs:
        assert t.truncated and t.score == 0.0 and len(t.turns) <= 2
        assert t.metrics["game/win"] == t.metrics["game/loss"] == 0.0


def test_a_game_that_raises_ends_alone(formatter, monkeypatch):
    run = runner(formatter, RecordingSampler(formatter))
    original = G.TextArenaMatch.move

    def move(self, reply):  # game 1's moves raise inside TextArena's step
        if self.raises:
            raise RuntimeError("boom")
        return original(self, reply)

    monkeypatch.setattr(G.TextArenaMatch, "move", move)
    factory = run.factory

    def marked(spec, run_seed):
        match = factory(spec, run_seed)
        match.raises = spec.group_id == 1
        return match

    run.factory = marked
    trajs = run.run(games(3), sample_seed=0)
    for t in trajs:
        failed = t.group_id == 1
        assert t.metrics["env_error"] == float(failed)
        assert t.terminated == (not failed) and t.truncated == failed
    assert run.stats["errors"] == 1
