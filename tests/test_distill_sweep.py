"""scripts/analysis/distill_sweep.py: the teacher's score, the two arms it launches, and the
"≤ 1/3 of RL's steps" bar, on hand-made runs."""

import json
import os
import sys

import pytest

from tests.conftest import load_script


@pytest.fixture(scope="module")
def sweep():
    return load_script("scripts/analysis/distill_sweep.py")


def _summary(reached, last):
    return {"reached_step": reached, "last_step_in_budget": last}


def test_the_bar_is_a_third_of_rls_steps(sweep):
    assert sweep.bar_met(_summary(30, 30), _summary(10, 10), 3.0)
    assert not sweep.bar_met(_summary(30, 30), _summary(12, 12), 3.0)
    # Distillation that never reached the target fails, whatever RL did.
    assert not sweep.bar_met(_summary(None, 40), _summary(None, 40), 3.0)
    # RL that did not get there in its budget needs more than its last step: a lower bound.
    assert sweep.bar_met(_summary(None, 60), _summary(20, 20), 3.0)
    assert not sweep.bar_met(_summary(None, 60), _summary(22, 22), 3.0)


def test_one_sweep_runs_both_arms_on_every_seed_against_the_teachers_last_eval(
        sweep, tmp_path, monkeypatch, capsys):
    teacher = tmp_path / "teacher"
    teacher.mkdir()
    with open(teacher / "metrics.jsonl", "w") as f:
        for step, success in [(50, 0.6), (100, 0.8)]:
            f.write(json.dumps({"step": step, "eval/success": success}) + "\n")
    seen = []

    def fake_run_jobs(jobs, free, budget_s, *, stop_at_target):
        seen.extend(jobs)
        assert stop_at_target and budget_s == 600
        # RL needs 30 steps on both seeds; distillation 10 on seed 0 and 12 on seed 1.
        steps = {("rl", 0): 30, ("rl", 1): 30, ("distill", 0): 10, ("distill", 1): 12}
        return {job["key"]: _summary(steps[job["key"]], steps[job["key"]]) for job in jobs}

    monkeypatch.setattr(sweep, "run_jobs", fake_run_jobs)
    monkeypatch.setattr(sys, "argv", [
        "distill_sweep.py", "--rl-config", "rl.py", "--distill-config", "kd.py",
        "--teacher", str(teacher), "--seeds", "0-1", "--budget-min", "10",
        "--out", str(tmp_path / "out"), "--config.max_steps=40",
        "--distill-set", "learning_rate=3e-3"])
    sweep.main()
    report = json.loads(capsys.readouterr().out)
    assert report["teacher_eval"] == 0.8 and report["teacher_step"] == 100
    assert report["target"] == pytest.approx(0.72)
    assert report["steps"] == {"0": [30, 10], "1": [30, 12]}
    assert report["seeds"]["0"]["bar_met"] and not report["seeds"]["1"]["bar_met"]
    assert not report["all_met"]
    assert {(job["key"], job["config"]) for job in seen} == {
        (("rl", 0), "rl.py"), (("distill", 0), "kd.py"), (("rl", 1), "rl.py"),
        (("distill", 1), "kd.py")}
    for job in seen:
        assert job["target"] == pytest.approx(0.72) and job["gain"] is None
        assert "--config.max_steps=40" in job["overrides"]
        distill = job["key"][0] == "distill"
        assert (f"--config.teacher.pretrain={teacher}" in job["overrides"]) == distill
        assert ("--config.learning_rate=3e-3" in job["overrides"]) == distill


def test_the_teacher_is_a_seed_0_run_of_the_rl_recipe_and_a_failed_one_stops_the_sweep(
        sweep, tmp_path, monkeypatch):
    import subprocess
    import time

    launched = []

    def fake_launch(config, seed, out, overrides, cores, exit_code=0):
        launched.append((config, seed, out, overrides))
        run_dir = os.path.join(out, f"seed{seed}")
        os.makedirs(run_dir, exist_ok=True)
        proc = subprocess.Popen([sys.executable, "-c", f"raise SystemExit({exit_code})"])
        return {"proc": proc, "log": open(os.path.join(run_dir, "train.log"), "w"),
                "start": time.monotonic(), "metrics": os.path.join(run_dir, "metrics.jsonl"),
                "cores": cores}

    monkeypatch.setattr(sweep, "launch", fake_launch)
    run_dir = sweep.train_teacher("rl.py", 100, str(tmp_path), ["--config.x=1"], {0})
    assert run_dir == os.path.join(str(tmp_path), "teacher", "seed0")
    assert launched == [("rl.py", 0, os.path.join(str(tmp_path), "teacher"),
                         ["--config.max_steps=100", "--config.x=1"])]
    monkeypatch.setattr(sweep, "launch",
                        lambda *a: fake_launch(*a, exit_code=3))
    with pytest.raises(SystemExit, match="teacher's run exited 3"):
        sweep.train_teacher("rl.py", 100, str(tmp_path), [], {0})
