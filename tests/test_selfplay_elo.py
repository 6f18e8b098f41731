"""scripts/analysis/selfplay_elo.py: the Bradley–Terry Elo fit against hand-computed
strengths (the table over a real run's checkpoints: tests/test_recipes.py)."""

import math

import pytest

from tests.conftest import load_script


@pytest.fixture(scope="module")
def elo():
    return load_script("scripts/analysis/selfplay_elo.py").bradley_terry_elo


def test_two_players_three_to_one(elo):
    # P(A beats B) = γA / (γA + γB) = 3/4 → γA/γB = 3 → 400·log10(3) Elo.
    out = elo({("A", "B"): (3, 0, 1)}, anchor="B")
    assert out["B"] == 0.0 and out["A"] == pytest.approx(400 * math.log10(3), abs=0.05)


def test_consistent_results_give_the_exact_strengths(elo):
    # γ = (9, 3, 1) predicts exactly these shares (3/4, 3/4, 9/10): the MLE is γ itself.
    out = elo({("A", "B"): (30, 0, 10), ("B", "C"): (30, 0, 10), ("A", "C"): (36, 0, 4)},
              anchor="C")
    assert out["A"] == pytest.approx(400 * math.log10(9), abs=0.05)
    assert out["B"] == pytest.approx(400 * math.log10(3), abs=0.05)


def test_draws_are_half_a_win_and_shutouts_are_unbounded(elo):
    assert elo({("A", "B"): (1, 2, 1)}, anchor="B")["A"] == pytest.approx(0.0, abs=1e-6)
    out = elo({("A", "B"): (2, 0, 2), ("C", "A"): (0, 0, 4), ("C", "B"): (0, 0, 4)},
              anchor="B")
    assert out["C"] == -math.inf and out["A"] == pytest.approx(0.0, abs=1e-6)
