"""scripts/analysis/plot_curves.py: the PNG, the medians and target crossings it reports,
and its errors."""

import json

import pytest
from PIL import Image

from tests.conftest import load_script


@pytest.fixture(scope="module")
def plot():
    return load_script("scripts/analysis/plot_curves.py")


def _write_run(run_dir, evals):
    """metrics.jsonl as train.run writes it: a train-only record (no eval/success) before
    each eval record."""
    run_dir.mkdir(parents=True)
    with open(run_dir / "metrics.jsonl", "w") as f:
        for step, elapsed, success in evals:
            f.write(json.dumps({"step": step - 1, "time/elapsed": elapsed - 5.0,
                                "env/success": 0.5}) + "\n")
            f.write(json.dumps({"step": step, "time/elapsed": elapsed,
                                "eval/success": success}) + "\n")


@pytest.fixture
def sweeps(tmp_path):
    """Sweep A: three seeds with evals on whole minutes, seed2 stopped early (at 2 min).
    Sweep B: two seeds whose evals fall at different times (interpolated onto each other's)."""
    a, b = tmp_path / "a", tmp_path / "b"
    _write_run(a / "seed0", [(10, 60, 0.2), (20, 120, 0.6), (30, 180, 0.9)])
    _write_run(a / "seed1", [(10, 60, 0.0), (20, 120, 0.4), (30, 180, 0.7), (40, 240, 1.0)])
    _write_run(a / "seed2", [(10, 60, 0.5), (20, 120, 0.8)])
    (a / "seed3").mkdir()  # a seed whose run wrote nothing: not a run
    (a / "seed3" / "train.log").write_text("crashed\n")
    _write_run(b / "seed0", [(10, 90, 0.1), (20, 210, 0.5)])
    _write_run(b / "seed1", [(10, 60, 0.0), (20, 150, 0.3), (30, 270, 0.6)])
    return a, b


def _summary(capsys):
    lines = capsys.readouterr().out.strip().splitlines()
    assert len(lines) == 1
    return json.loads(lines[0])


def test_two_sweeps_by_minutes(plot, sweeps, tmp_path, capsys):
    a, b = sweeps
    out = tmp_path / "figs" / "curves.png"
    argv = ["--run", f"A={a}", "--run", f"B={b}", "--target", "0.8", "--title", "two recipes"]
    assert plot.main([*argv, "--out", str(out)]) == 0
    summary = _summary(capsys)
    with Image.open(out) as image:
        assert image.format == "PNG"
        assert image.size == (1200, 675)
    assert summary["x"] == "minutes" and summary["metric"] == "eval/success"

    # A on minutes 1..4: seeds (0.2, 0.0, 0.5), (0.6, 0.4, 0.8), (0.9, 0.7, 0.8 held),
    # (0.9 held, 1.0, 0.8 held): medians 0.2, 0.6, 0.8, 0.9; 0.8 first at 3 minutes.
    la = summary["labels"]["A"]
    assert la["seeds"] == 3 and la["runs"] == {"seed0": 3, "seed1": 4, "seed2": 2}
    assert la["points"] == 9
    assert (la["x_start"], la["x_end"]) == (1.0, 4.0)
    assert la["final_median"] == pytest.approx(0.9)
    assert (la["final_min"], la["final_max"]) == (pytest.approx(0.8), pytest.approx(1.0))
    assert la["reached_x"] == pytest.approx(3.0)

    # B's grid starts at 1.5 min (seed0's first eval) and holds 1.5, 2.5, 3.5, 4.5:
    # seed0 0.1, 0.3 (interpolated), 0.5, 0.5 (held); seed1 0.15, 0.3, 0.45, 0.6.
    # Medians 0.125, 0.3, 0.475, 0.55: never 0.8.
    lb = summary["labels"]["B"]
    assert lb["seeds"] == 2 and lb["points"] == 5
    assert (lb["x_start"], lb["x_end"]) == (1.5, 4.5)
    assert lb["final_median"] == pytest.approx(0.55)
    assert lb["reached_x"] is None

    # The same inputs give the same bytes.
    first = out.read_bytes()
    again = tmp_path / "again.png"
    assert plot.main([*argv, "--out", str(again)]) == 0
    capsys.readouterr()
    assert again.read_bytes() == first


def test_by_step_and_a_single_run_dir(plot, sweeps, tmp_path, capsys):
    a, _ = sweeps
    out = tmp_path / "steps.png"
    assert plot.main(["--run", f"A={a}", "--run", f"one={a / 'seed1'}", "--out", str(out),
                      "--x", "step", "--target", "0.8"]) == 0
    summary = _summary(capsys)
    la, one = summary["labels"]["A"], summary["labels"]["one"]
    assert (la["x_start"], la["x_end"], la["reached_x"]) == (10.0, 40.0, 30.0)
    # A DIR with its own metrics.jsonl is one run: its median is the run itself.
    assert one["seeds"] == 1 and one["runs"] == {"seed1": 4}
    assert one["final_median"] == pytest.approx(1.0) and one["reached_x"] == 40.0
    assert out.exists()


def test_a_resumed_run_continues_its_time_and_bad_values_are_skipped(plot, tmp_path):
    run = tmp_path / "resumed"
    # Stopped after step 20 (at 2 min) and resumed: time/elapsed restarts from 0, so step
    # 30's 30 s is 2.5 minutes into the whole run. A non-finite value is written as a string.
    _write_run(run, [(10, 60, 0.1), (20, 120, 0.2), (30, 30, 0.3), (40, 60, "nan")])
    with open(run / "metrics.jsonl", "a") as f:
        f.write('{"step": 50, "time/ela')  # killed mid-write
    curve = plot.read_curve(str(run / "metrics.jsonl"), "eval/success", "minutes")
    assert curve == [(1.0, 0.1), (2.0, 0.2), (2.5, 0.3)]


def test_errors_are_one_line_and_exit_status_2(plot, sweeps, tmp_path, capsys):
    a, _ = sweeps
    empty = tmp_path / "empty"
    empty.mkdir()
    out = str(tmp_path / "x.png")
    cases = [
        (["--run", f"A={tmp_path / 'missing'}"], "no such directory"),
        (["--run", f"A={empty}"], "holds no metrics.jsonl"),
        (["--run", f"A={a}", "--metric", "eval/return"], "logs 'eval/return'"),
        (["--run", str(a)], "is not LABEL=DIR"),
        (["--run", f"A={a}", "--run", f"A={a}"], "given twice"),
    ]
    for argv, message in cases:
        assert plot.main([*argv, "--out", out]) == 2
        captured = capsys.readouterr()
        err = captured.err.strip().splitlines()
        assert len(err) == 1 and err[0].startswith("error: ") and message in err[0], err
        assert captured.out == ""
    assert not (tmp_path / "x.png").exists()
