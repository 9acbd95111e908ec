"""A sweep's points report: forge-train returns each point's objective (its last validation loss, what a sweeper
such as hydra-optuna-sweeper minimises), and forge-sweep-report ranks the points by it, with a CSV and a plot."""

import csv
import shutil
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def test_a_sweep_reports_each_point_ranked_by_validation_loss(tmp_path):
    sweep = tmp_path / "sweep"
    done = subprocess.run(
        [sys.executable, "-m", "forge.train", "-m", "optimizer.lr=1e-4,3e-3", "debug=fast",
         f"hydra.sweep.dir={sweep}", "+hydra.callbacks.record._target_=tests.launch.sweep_callback.RecordReturn"],
        cwd=ROOT, capture_output=True, text=True, timeout=600,
    )  # fmt: skip
    assert done.returncode == 0, done.stderr[-3000:]
    returned = {p: float((sweep / p / "return_value.txt").read_text()) for p in ("0", "1")}
    # a point that ended early: a copy of the first, its metrics cut after the first logged step
    shutil.copytree(sweep / "0", sweep / "2")
    lines = (sweep / "2" / "metrics.jsonl").read_text().splitlines()
    (sweep / "2" / "metrics.jsonl").write_text("\n".join(lines[:2]) + "\n")
    report = subprocess.run(
        [sys.executable, "-m", "forge.launch.sweep_report", str(sweep)], capture_output=True, text=True, timeout=120
    )
    assert report.returncode == 0, report.stderr
    rows = list(csv.DictReader((sweep / "sweep_report.csv").open()))
    by_point = {row["point"]: row for row in rows}
    assert {p: float(by_point[p]["val_loss"]) for p in ("0", "1")} == returned  # the objective is the report's
    assert by_point["0"]["status"] == by_point["1"]["status"] == "done"
    assert by_point["2"]["status"] == "stopped at step 1"
    val = [float(row["val_loss"]) for row in rows]
    assert val == sorted(val)  # ranked, lowest first
    assert rows[0]["overrides"] == "optimizer.lr=0.003 debug=fast"  # 5 steps at 3e-3 beat 5 at 1e-4
    assert (sweep / "sweep_curves.png").stat().st_size > 0
    assert "optimizer.lr=0.0001 debug=fast" in report.stdout


def test_a_refused_point_is_recorded_and_the_sweep_runs_the_others(tmp_path):
    sweep = tmp_path / "sweep"
    done = subprocess.run(
        [sys.executable, "-m", "forge.train", "-m", "model.n_heads=3,4", "debug=fast", f"hydra.sweep.dir={sweep}"],
        cwd=ROOT, capture_output=True, text=True, timeout=600,
    )  # fmt: skip
    assert done.returncode == 2, done.stderr[-3000:]  # as the refused point alone would
    # named before any point runs, and again once the others have run
    assert "refused, the other points run: sweep point model.n_heads=3 debug=fast: model.dim=256" in done.stderr
    assert f"the others ran: forge-sweep-report {sweep}" in done.stderr
    assert "Traceback" not in done.stderr, done.stderr[-3000:]
    report = subprocess.run(
        [sys.executable, "-m", "forge.launch.sweep_report", str(sweep)], capture_output=True, text=True, timeout=120
    )
    by_point = {row["point"]: row for row in csv.DictReader((sweep / "sweep_report.csv").open())}
    assert by_point["0"]["status"] == "refused: model.dim=256 is not divisible by model.n_heads=3", report.stdout
    assert by_point["1"]["status"] == "done" and float(by_point["1"]["val_loss"]) > 0


def test_a_folder_without_points_is_one_line_and_exit_2(tmp_path):
    report = subprocess.run(
        [sys.executable, "-m", "forge.launch.sweep_report", str(tmp_path)], capture_output=True, text=True, timeout=60
    )
    assert report.returncode == 2 and len(report.stderr.strip().splitlines()) == 1, report.stderr
