"""scripts/analysis/seed_sweep.py: seed lists, and the per-seed curve summary it prints."""

import json

import pytest

from tests.conftest import load_script


@pytest.fixture(scope="module")
def sweep():
    return load_script("scripts/analysis/seed_sweep.py")


def test_seed_lists(sweep):
    assert sweep.parse_seeds("0-4") == [0, 1, 2, 3, 4]
    assert sweep.parse_seeds("3,7,1-2") == [3, 7, 1, 2]


def _write_run(path, evals):
    """metrics.jsonl with a train-only record between evals, as train.run writes it."""
    with open(path, "w") as f:
        for step, elapsed, success in evals:
            f.write(json.dumps({"step": step - 1, "time/elapsed": elapsed - 5.0}) + "\n")
            f.write(json.dumps({"step": step, "time/elapsed": elapsed,
                                "eval/success": success}) + "\n")


def test_summary_of_a_run_that_reaches_the_target_and_one_past_the_budget(sweep, tmp_path):
    path = tmp_path / "metrics.jsonl"
    # Steps 10..50 at 2, 4, ... 10 minutes; 0.8 is first reached at step 40 (8 min).
    _write_run(path, [(10, 120, 0.1), (20, 240, 0.5), (30, 360, 0.75), (40, 480, 0.8),
                      (50, 600, 0.7)])
    evals = sweep.read_evals(str(path))
    assert [e[0] for e in evals] == [10, 20, 30, 40, 50]
    summary = sweep.summarize(evals, budget_s=600, target=0.8)
    assert summary["reached_step"] == 40 and summary["reached_min"] == 8.0
    assert summary["success_at_budget"] == 0.7 and summary["best"] == 0.8
    assert summary["late_mean"] == pytest.approx((0.75 + 0.8 + 0.7) / 3, abs=1e-4)
    assert summary["curve"][0] == [10, 2.0, 0.1]
    # With a 7-minute budget the step-40 eval (8 min) no longer counts.
    late = sweep.summarize(evals, budget_s=420, target=0.8)
    assert late["reached_step"] is None and late["success_at_budget"] == 0.75
    assert late["last_step_in_budget"] == 30


def test_a_gain_is_measured_from_the_runs_own_first_eval(sweep, tmp_path):
    path = tmp_path / "metrics.jsonl"
    _write_run(path, [(10, 120, 0.2), (20, 240, 0.45), (30, 360, 0.5), (40, 480, 0.6)])
    summary = sweep.summarize(sweep.read_evals(str(path)), budget_s=600, target=0.8,
                              gain=0.3)
    assert summary["first_eval"] == 0.2 and summary["target"] == 0.5
    assert summary["reached_step"] == 30 and summary["reached_min"] == 6.0
    # A first eval already high does not count as its own gain.
    flat = sweep.summarize([(10, 60.0, 0.9)], budget_s=600, target=0.8, gain=0.0)
    assert flat["reached_step"] is None


def test_summary_of_a_run_without_evals(sweep, tmp_path):
    assert sweep.read_evals(str(tmp_path / "missing.jsonl")) == []
    summary = sweep.summarize([], budget_s=60, target=0.8)
    assert summary["reached_step"] is None and summary["success_at_budget"] is None


def test_stop_at_target_ends_a_run_at_its_first_eval_at_the_target(sweep, tmp_path,
                                                                     monkeypatch):
    """A run that reached the target is terminated (exit "reached"), not left to its budget;
    one that has not is left running. The stand-in training process writes its evals and
    then blocks on stdin, so only the sweep can end it."""
    import argparse
    import subprocess
    import sys
    import time

    evals = {0: [(10, 60, 0.5), (20, 120, 0.85)], 1: [(10, 60, 0.5)]}

    def fake_launch(config, seed, out, overrides, cores):
        metrics = tmp_path / f"seed{seed}.jsonl"
        _write_run(metrics, evals[seed])
        proc = subprocess.Popen([sys.executable, "-c", "import sys; sys.stdin.read()"],
                                stdin=subprocess.PIPE)
        return {"seed": seed, "proc": proc, "log": open(tmp_path / f"{seed}.log", "w"),
                "start": time.monotonic(), "metrics": str(metrics), "cores": cores}

    monkeypatch.setattr(sweep, "launch", fake_launch)
    args = argparse.Namespace(config="c.py", seeds="0", budget_min=10.0, target=0.8,
                              out=str(tmp_path), stop_at_target=True, gain=None)
    results = sweep.run_all(args, [], [{0}], poll_s=0.01)
    assert results[0]["exit"] == "reached" and results[0]["reached_step"] == 20
    # Seed 1 never reaches 0.8: with a budget it cannot pass, it is stopped for the budget.
    args.seeds, args.budget_min = "1", -1.5
    results = sweep.run_all(args, [], [{0}], poll_s=0.01)
    assert results[1]["exit"] == "budget" and results[1]["reached_step"] is None
