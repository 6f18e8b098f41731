"""`textarena:<two-player id>`: matches against the same games driven through TextArena's
own API (`textarena.make(id)` with its `LLMObservationWrapper` per-player view), private
observations, zero-sum rewards, random seats, invalid moves, config errors."""

import random
from pathlib import Path

import pytest
import textarena as ta

from jaxrl_agentic.envs import textarena_games as G
from jaxrl_agentic.envs.python_env import make_python_env
from jaxrl_agentic.rollout.groups import EpisodeSpec


def match(env_id, seed=0, group=0, member=0, **config):
    factory = make_python_env(f"textarena:{env_id}", **config)
    return factory(EpisodeSpec(seed=seed, group_id=group, member=member), 0)


def legal_or_not(rng, text, invalid_share=0.2):
    """A listed move, or (sometimes) one that is not legal."""
    moves = G.listed_moves(text)
    if not moves or rng.random() < invalid_share:
        return rng.choice(["[9]", "[raise]", "hello"])
    return rng.choice(moves)


def play_both(env_id, seed, policy_seed):
    """Plays the same moves on a self-play match and on TextArena's own env; checks each
    player's view and the outcome, → (rewards, seat texts)."""
    m = match(env_id, seed=seed)
    m.start(seed)
    raw = ta.make(env_id)
    raw.reset(num_players=2, seed=seed)
    seen, last_action, rng = {0: "", 1: ""}, {}, random.Random(policy_seed)
    texts = {0: [], 1: []}
    done = False
    while not done:
        pid, full = raw.get_observation()
        assert m.current_seat == pid
        text = m.observe()
        texts[pid].append(text)
        added, seen[pid] = full[len(seen[pid]):], full
        # TextArena's view adds the echo of the player's own last action (the reply itself).
        echo = f"\n[Player {pid}] {last_action[pid]}" if pid in last_action else ""
        assert added == echo + "\n" + text
        action = legal_or_not(rng, "\n".join(texts[pid]))
        last_action[pid] = raw.action(action)  # as its ActionFormattingWrapper passes it on
        move = m.move(action)
        done, _ = raw.step(action)
        assert move.done == done and move.seat == pid
    rewards, info = raw.close()
    assert m.rewards() == {0: float(rewards[0]), 1: float(rewards[1])}
    for seat in (0, 1):
        assert m.lost_on_invalid_move(seat) == info[seat]["invalid_move"]
    return m.rewards(), texts


@pytest.mark.parametrize("env_id", ["TicTacToe-v0", "KuhnPoker-v0"])
def test_matches_textarena_own_api(env_id):
    outcomes = set()
    for seed in range(6):
        rewards, _ = play_both(env_id, seed, policy_seed=seed)
        assert rewards[0] + rewards[1] == 0.0  # zero-sum
        outcomes.add(rewards[0])
    assert outcomes & {1.0, -1.0}  # games were decided, not all drawn


def test_kuhn_poker_cards_are_private():
    for seed in range(5):
        _, texts = play_both("KuhnPoker-v0", seed, policy_seed=100 + seed)
        cards = {seat: {line for t in texts[seat] for line in t.splitlines()
                        if "Your card is" in line} for seat in (0, 1)}
        assert cards[0] and cards[1]
        # The rounds' card lines name the round, and a round deals two different cards.
        assert not cards[0] & cards[1]
        raw = ta.make("KuhnPoker-v0")
        raw.reset(num_players=2, seed=seed)
        first = raw.state.game_state["player_cards"]  # (wrappers pass attributes on)
        name = {0: "J", 1: "Q", 2: "K"}
        for seat in (0, 1):
            assert f"[GAME] ### Starting round 1 out of 3 rounds. Your card is: " \
                   f"'{name[first[seat]]}'" in cards[seat]


def test_random_seat_plays_listed_moves():
    wins = invalid = 0
    for seed in range(20):
        m = match("TicTacToe-v0", seed=seed, seats=("random", "policy"))
        m.start(seed)
        rng = random.Random(seed)
        seen = []
        while not m.done:
            assert m.current_seat == 1  # the random seat moved already
            seen.append(m.observe())
            move = m.move(rng.choice(G.listed_moves("\n".join(seen))))
            assert move.valid
        assert m.invalid_moves == [0, 0] and m.opponent_fallbacks == 0
        assert m.opponent_moves >= 3  # a win takes three moves
        wins += m.rewards()[1] > 0
        invalid += m.lost_on_invalid_move(0)
    assert invalid == 0 and 0 < wins < 20


def test_random_seat_falls_back_when_no_moves_are_listed(monkeypatch):
    m = match("TicTacToe-v0", seats=("random", "policy"), random_fallback_reply="[4]")
    assert G.listed_moves("no moves here") == []
    m.start(0)
    assert m.opponent_fallbacks == 0
    # A game that lists nothing: the listing is hidden from the random seat.
    monkeypatch.setattr(G, "listed_moves", lambda text: [])
    m.start(1)
    assert m.opponent_fallbacks == 1
    assert "cell 4" in m.observe()  # the fallback move was played


def test_invalid_moves_counted_and_second_in_a_row_loses():
    m = match("TicTacToe-v0")
    m.start(0)
    first = m.move("[4]")
    assert first.valid and m.current_seat == 1
    forgiven = m.move("[4]")  # occupied: forgiven once, the same seat moves again
    assert not forgiven.valid and not forgiven.done and m.current_seat == 1
    assert "attempted an invalid move" in m.observe()
    lost = m.move("no move")
    assert not lost.valid and lost.done
    assert m.invalid_moves == [0, 2] and m.lost_on_invalid_move(1)
    assert m.rewards() == {0: 1.0, 1: -1.0}
    metrics = m.seat_metrics(1)
    assert (metrics["game/loss"], metrics["game/invalid_moves"], metrics["game/invalid_loss"]
            ) == (1.0, 2.0, 1.0)


def test_alternate_seats_swap_on_odd_groups():
    config = dict(seats=("policy", "random"), alternate_seats=True)
    assert match("TicTacToe-v0", group=0, **config).seats == ("policy", "random")
    assert match("TicTacToe-v0", group=1, **config).seats == ("random", "policy")
    assert match("TicTacToe-v0", group=2, **config).seats == ("policy", "random")
    assert match("TicTacToe-v0").seats == ("policy", "policy")  # self-play by default


def test_one_stream_view_is_the_policy_seat_against_random():
    m = match("TicTacToe-v0", seed=3, seats=("random", "policy"))
    text = m.reset(3)
    assert "You are Player 1" in text and "Player 0 placed" in text
    rng, step = random.Random(0), None
    while step is None or not step.terminated:
        step = m.step(rng.choice(G.listed_moves(text)))
        text = step.observation or text
    assert step.reward == m.rewards()[1] and step.success == (step.reward > 0)


def test_game_metrics_rates():
    rows = [{"game/win": w, "game/loss": lo, "game/draw": d, "game/invalid_moves": i,
             "game/invalid_loss": il, "game/seat": s, "game/opponent_fallbacks": 0.0}
            for w, lo, d, i, il, s in [(1, 0, 0, 0, 0, 0), (0, 1, 0, 2, 1, 1),
                                       (0, 0, 1, 1, 0, 0), (0, 0, 0, 0, 0, 1)]]
    out = G.game_metrics(rows + [{"success": 1.0}], "eval/")
    assert out["eval/win_rate"] == 0.25 and out["eval/loss_rate"] == 0.25
    assert out["eval/draw_rate"] == 0.25 and out["eval/invalid_moves"] == 0.75
    assert out["eval/invalid_loss_rate"] == 0.25
    assert out["eval/seat0/win_rate"] == 0.5 and out["eval/seat1/win_rate"] == 0.0
    assert G.game_metrics([{"success": 1.0}], "eval/") == {}


@pytest.mark.parametrize("config, message", [
    (dict(seats=("policy", "radnom")), "^seats: unknown seat kind 'radnom'; allowed: "
                                        "policy, random, frozen:<k>, frozen:start, "
                                        "model:<path>$"),
    (dict(seats=("policy", "frozen:0")), "^seats: 'frozen:0': a frozen seat is"),
    (dict(seats=("policy", "frozen:last")), "^seats: 'frozen:last': a frozen seat is"),
    (dict(seats=("frozen:2", "frozen:start")), "^seats: at least one seat must be"),
    (dict(seats=("policy",)), "^seats: must list 2 seat kinds"),
    (dict(seats="policy"), "^seats: must list 2 seat kinds"),
    (dict(seats=("random", "random")), "^seats: at least one seat must be 'policy'"),
    (dict(alternate_seats=True), "^alternate_seats: swapping"),
    (dict(random_fallback_reply=""), "^random_fallback_reply: must be"),
    (dict(seat=("policy", "random")), "unknown config \\['seat'\\]"),
])
def test_config_errors_are_one_line_naming_the_field(config, message):
    with pytest.raises(ValueError, match=message) as e:
        make_python_env("textarena:TicTacToe-v0", **config)
    assert "\n" not in str(e.value)


def test_two_player_ids():
    ids = G.offline_two_player_ids()
    for env_id in ("TicTacToe-v0", "KuhnPoker-v0", "ConnectFour-v0", "Nim-v0"):
        assert env_id in ids
    assert "WordChains-v0" not in ids and "WordChains-v0" in G.two_player_ids()
    with pytest.raises(ValueError, match="needs the network"):
        make_python_env("textarena:WordChains-v0")


def test_recipe_with_a_misspelt_seat_kind_is_one_config_error():
    from jaxrl_agentic.config import ConfigError, recipe_config, validate

    c = recipe_config(str(Path(__file__).parents[2] / "configs" / "textarena_selfplay.py"))
    validate(c)
    c.custom_envs.game.env_config = {"seats": ("policy", "radnom")}
    with pytest.raises(ConfigError) as e:
        validate(c)
    assert str(e.value) == ("config.custom_envs.game.env_type: seats: unknown seat kind "
                            "'radnom'; allowed: policy, random, frozen:<k>, frozen:start, "
                            "model:<path>")
