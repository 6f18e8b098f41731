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


class ParamsRecordingSampler(RecordingSampler):
    """RecordingSampler that also records the params of each call (a frozen seat's calls
    must carry its snapshot's, the policy's calls the policy's)."""

    def new_session(self, num_rows):
        session, sampler = super().new_session(num_rows), self
        generate = session.generate

        def recorded(rows, *, params=None, **kwargs):
            sampler.calls_params = [*getattr(sampler, "calls_params", []), params]
            return generate(rows, params=params, **kwargs)

        session.generate = recorded
        return session


def frozen_pool(versions):
    from jaxrl_agentic.rollout.snapshots import PolicySnapshots

    pool = PolicySnapshots(keep=2)
    for v in versions:
        pool.record(v, {"version": np.int32(v)})
    return pool


def test_frozen_seat_plays_its_snapshot_in_its_own_stream_and_is_no_trajectory(formatter):
    config = dict(seats=("policy", "frozen:2"), alternate_seats=True)
    sampler = ParamsRecordingSampler(formatter, invalid=0.2, seed=8)
    run = runner(formatter, sampler, config)
    assert run.frozen_kinds == ("frozen:2",)
    with pytest.raises(RuntimeError, match="other params than the policy"):
        run.run(games(2), sample_seed=0)
    run.snapshots = frozen_pool(range(6))  # newest 5: frozen:2 is version 3
    policy = {"version": "policy"}
    specs = games(6)
    sampler.calls, sampler.calls_params = [], []
    trajs = run.run(specs, sample_seed=4, traj_id_start=10, params=policy)
    # Only the policy's seats are trajectories (samples, gradients); alternate groups swap.
    assert len(trajs) == len(specs)
    assert [t.seat for t in sorted(trajs, key=lambda t: t.group_id)] == [0, 1] * 3
    opponents = {t.group_id: t for t in run.last_opponents}
    assert sorted(opponents) == list(range(6))
    for t in trajs:
        o = opponents[t.group_id]
        assert o.seat == 1 - t.seat and o.metrics["frozen_version"] == 3.0
        assert o.traj_id == 10 + t.group_id + o.seat * SEAT_ID_STRIDE
        streams, rewards = replay(formatter, specs[t.group_id], {t.seat: t, o.seat: o},
                                  {"seats": ("policy", "policy")})
        assert t.tokens == streams[t.seat] and o.tokens == streams[o.seat]
        assert t.score == rewards[t.seat] and rewards[0] + rewards[1] == 0.0
    # Each call is one params' rows: the policy's with the policy, the opponent's with v3.
    by_row = {r: k for r, k in enumerate(["policy"] * len(trajs) + ["frozen"] * len(trajs))}
    for (rows, _, _), params in zip(sampler.calls, sampler.calls_params, strict=True):
        kinds = {by_row[r] for r in rows}
        assert len(kinds) == 1
        assert params is policy if kinds == {"policy"} else int(params["version"]) == 3
    assert run.stats["frozen_moves"] == sum(len(o.turns) for o in opponents.values())


def test_policy_snapshots_keep_the_start_and_the_newest():
    from jaxrl_agentic.rollout.snapshots import PolicySnapshots

    pool = frozen_pool([0])
    assert pool.params_for("frozen:2")[0] == 0  # younger than k: the start
    for v in range(1, 8):
        pool.record(v, {"version": np.int32(v)})
    assert pool.versions == [0, 5, 6, 7]  # the start and keep + 1 = 3 newest
    assert pool.params_for("frozen:1")[0] == 6 and pool.params_for("frozen:2")[0] == 5
    assert pool.params_for("frozen:start")[0] == 0
    pool.record(7, {"version": np.int32(99)})  # a version is recorded once
    assert int(pool.params_for("frozen:1")[1]["version"]) == 6
    start_only = PolicySnapshots.for_kinds(["policy", "frozen:start"])
    for v in range(3):
        start_only.record(v, {"version": np.int32(v)})
    assert start_only.versions == [0]  # nothing but the start is read
    assert PolicySnapshots.for_kinds(["policy", "random"]) is None
    assert PolicySnapshots.for_kinds(["frozen:3"]).keep == 3


def test_snapshot_is_a_copy_of_donated_params():
    import jax
    import jax.numpy as jnp

    from jaxrl_agentic.rollout.snapshots import PolicySnapshots

    params = {"w": jnp.arange(4.0)}
    pool = PolicySnapshots(keep=1)
    pool.record(0, params)
    jax.jit(lambda p: jax.tree.map(lambda x: x + 1, p), donate_argnums=0)(params)
    np.testing.assert_array_equal(pool.params_for("frozen:start")[1]["w"], np.arange(4.0))


def test_frozen_seat_logprobs_are_its_versions(tiny_model_dir):
    """Played by the real sampler, a frozen seat's sampled logprobs are those of the
    version it claims (the full forward of its stream under that version's params), not the
    policy's; the policy seat's are the policy's."""
    import jax
    import jax.numpy as jnp
    from flax import nnx

    from jaxrl_agentic.rollout.snapshots import PolicySnapshots
    from jaxrl_agentic.sampling import Sampler

    model, tok = load_pretrained(tiny_model_dir)
    formatter = ChatFormatter(tok)
    graphdef, v0 = nnx.split(model)
    noise = jax.random.PRNGKey(0)
    v1 = jax.tree.map(lambda x: x + 0.05 * jax.random.normal(noise, x.shape, x.dtype)
                      if jnp.issubdtype(x.dtype, jnp.floating) else x, v0)
    sampler = Sampler(model, tok, max_total_len=1400)
    # Alternate seats: each side moves first in one game (the untrained model's moves are
    # mostly invalid, and a seat may lose before the other one moved).
    run = make_runner("textarena:TicTacToe-v0",
                      {"seats": ("policy", "frozen:1"), "alternate_seats": True}, sampler,
                      formatter, tag="game", max_turns=2, max_input_length=1390,
                      generation=GenerationConfig(max_tokens_per_step=3), format_penalty=0.1)
    run.snapshots = PolicySnapshots(keep=1)
    run.snapshots.record(0, v0)
    run.snapshots.record(1, v1)
    trajs = run.run(games(2), sample_seed=1, params=v1)

    def forward_logprobs(params, t):
        logits = nnx.merge(graphdef, params)(jnp.asarray(t.tokens)[None],
                                             jnp.arange(len(t.tokens))[None])[0]
        lp = np.asarray(jax.nn.log_softmax(logits.astype(jnp.float32), axis=-1))
        return np.concatenate([lp[u.context_len - 1 + np.arange(len(u.generated)),
                                  u.generated] for u in t.turns])

    def sampled(t):
        return np.concatenate([u.logprobs for u in t.turns])

    assert any(o.turns for o in run.last_opponents) and any(t.turns for t in trajs)
    for o in (o for o in run.last_opponents if o.turns):
        assert o.metrics["frozen_version"] == 0.0
        np.testing.assert_allclose(sampled(o), forward_logprobs(v0, o), atol=2e-4)
        assert np.abs(sampled(o) - forward_logprobs(v1, o)).max() > 1e-2
    for t in (t for t in trajs if t.turns):
        np.testing.assert_allclose(sampled(t), forward_logprobs(v1, t), atol=2e-4)
