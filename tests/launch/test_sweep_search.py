"""Sweeps that search and resume: an Optuna search of the learning rate (hparams_search=lr_optuna,
hydra-optuna-sweeper) minimises the validation loss each point returns, a refused trial is recorded while the
search goes on, and a sweep run again into its folder keeps its finished points and resumes the others."""

import csv
import signal
import subprocess
import sys
from pathlib import Path

import yaml

from tests.conftest import ROOT, forge_cmd, one_line
from tests.launch.conftest import losses, start_sweep, tiny, wait_for_step

RECORD_RETURN = "+hydra.callbacks.record._target_=tests.launch.sweep_callback.RecordReturn"


def run(*args: str, timeout: float = 600) -> subprocess.CompletedProcess:
    return subprocess.run(forge_cmd(*args), cwd=ROOT, capture_output=True, text=True, timeout=timeout)


def report(sweep: Path) -> list[dict]:
    done = subprocess.run([sys.executable, "-m", "forge.launch.sweep_report", str(sweep)], capture_output=True,
                          text=True, timeout=120)  # fmt: skip
    assert done.returncode == 0, done.stderr
    return list(csv.DictReader((sweep / "sweep_report.csv").open()))


def test_an_optuna_search_ranks_its_trials_and_a_rerun_keeps_them(tmp_path):
    sweep = tmp_path / "search"
    command = ("hparams_search=lr_optuna", "hydra.sweeper.n_trials=4", "hydra.sweeper.sampler.n_startup_trials=2",
               *tiny("train.steps=4", "checkpoint.interval=0"),
               f"hydra.sweep.dir={sweep}", RECORD_RETURN)  # fmt: skip
    first = run(*command)
    assert first.returncode == 0, first.stderr[-3000:]
    points = sorted(p.name for p in sweep.iterdir() if p.name.isdigit())
    assert points == ["0", "1", "2", "3"]
    returned = {p: float((sweep / p / "return_value.txt").read_text()) for p in points}
    lrs = {p: yaml.safe_load((sweep / p / ".hydra" / "config.yaml").read_text())["optimizer"]["lr"] for p in points}
    assert len(set(lrs.values())) == 4 and all(1e-4 <= lr <= 3e-2 for lr in lrs.values()), lrs  # sampled, in range
    best = yaml.safe_load((sweep / "optimization_results.yaml").read_text())
    assert best["best_value"] == min(returned.values())  # Optuna minimised what each point returned
    rows = report(sweep)
    assert [float(r["val_loss"]) for r in rows] == sorted(returned.values())  # ranked by validation loss
    assert rows[0]["point"] == min(returned, key=returned.get)
    assert all(r["status"] == "done" for r in rows)

    metrics = {p: (sweep / p / "metrics.jsonl").read_bytes() for p in points}
    again = run(*command)
    assert again.returncode == 0, again.stderr[-3000:]
    assert again.stdout.count("sweep point kept") == 4, again.stdout[-3000:]
    assert "done:" not in again.stdout  # nothing trained
    assert {p: (sweep / p / "metrics.jsonl").read_bytes() for p in points} == metrics
    # the seeded search asked the same trials again, told the same values
    assert yaml.safe_load((sweep / "optimization_results.yaml").read_text()) == best


def test_a_search_whose_every_trial_is_refused_says_so_in_one_line(tmp_path):
    done = run("hparams_search=lr_optuna", "hydra.sweeper.n_trials=2", "optimizer.lr=interval(-1, -0.5)", "debug=fast",
               f"hydra.sweep.dir={tmp_path}")  # fmt: skip
    assert done.returncode == 2, done.stderr[-3000:]
    assert "Traceback" not in done.stderr
    assert "forge-train: no trial of the search finished (the last: invalid config: optimizer.lr=-" in done.stderr
    rows = report(tmp_path)
    assert len(rows) == 2 and all(r["status"].startswith("refused: optimizer.lr=-") for r in rows), rows


def test_a_search_interval_under_the_basic_sweeper_is_one_line(tmp_path):
    line = one_line(run("-m", "optimizer.lr=interval(1e-4, 1e-2)", f"hydra.sweep.dir={tmp_path / 's'}"))
    assert "optimizer.lr=interval(1e-4, 1e-2) is a search interval, which the basic sweeper cannot run" in line
    assert not (tmp_path / "s").exists()


def test_a_sweep_run_again_keeps_finished_points_and_resumes_the_stopped_one(tmp_path):
    """Two equal points: the first, run through, is the curve the second must give after a kill and a resume."""
    sweep = tmp_path / "sweep"
    command = (*tiny("train.steps=10", "checkpoint.interval=2"), "optimizer.lr=1e-3,1e-3")
    proc = start_sweep(sweep, *command)
    wait_for_step(sweep / "1", 5, proc)
    proc.send_signal(signal.SIGKILL)
    proc.wait(timeout=60)
    assert max(losses(sweep / "1")) < 10
    finished = (sweep / "0" / "metrics.jsonl").read_bytes()

    again = run("-m", *command, f"hydra.sweep.dir={sweep}")
    assert again.returncode == 0, again.stderr[-3000:]
    assert f"sweep point kept: {sweep / '0'} finished before" in again.stdout
    assert (sweep / "0" / "metrics.jsonl").read_bytes() == finished
    assert "resumed from" in (sweep / "1" / "forge.log").read_text()
    assert losses(sweep / "1") == losses(sweep / "0")
    assert [r["status"] for r in report(sweep)] == ["done", "done"]


def test_a_sweep_folder_holding_other_points_is_refused_and_left_as_it_was(tmp_path):
    sweep = tmp_path / "sweep"
    first = run("-m", *tiny("train.steps=2"), "optimizer.lr=1e-3", f"hydra.sweep.dir={sweep}")
    assert first.returncode == 0, first.stderr[-3000:]
    before = sorted(p.name for p in (sweep / "0").iterdir())
    other = run("-m", *tiny("train.steps=2"), "optimizer.lr=3e-3", f"hydra.sweep.dir={sweep}")
    assert other.returncode == 2, other.stderr[-3000:]
    assert "holds a run of other overrides" in other.stderr and "Traceback" not in other.stderr
    assert sorted(p.name for p in (sweep / "0").iterdir()) == before  # no failure record written into it
