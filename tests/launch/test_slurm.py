"""forge-train sweeps on a real SLURM through hydra-submitit-launcher: one job per point, multi-task DDP jobs,
the launch-shape check, and preemption -> requeue -> resume."""

import csv
import subprocess
import sys
import time

import pytest
import yaml

from forge.launch.sweep_report import read_point
from tests.conftest import ROOT, forge_cmd
from tests.launch.conftest import finish_sweep, losses, slurm_job_ids, start_sweep, sweep, tiny, wait_for_step

pytestmark = [pytest.mark.slow, pytest.mark.dist]

LOCAL_SLURM = "hydra/launcher=local_slurm"


def test_sweep_sends_one_job_per_point_each_in_its_own_subdir(slurm, tmp_path):
    code, out = sweep(tmp_path, LOCAL_SLURM, *tiny("train.steps=3"), "optimizer.lr=1e-3,3e-4")
    assert code == 0, out
    curves = [losses(tmp_path / str(n)) for n in (0, 1)]
    assert all(sorted(curve) == [1, 2, 3] for curve in curves), curves
    assert curves[0][3] != curves[1][3]  # different learning rates, different runs
    task_logs = sorted(p.name for p in (tmp_path / ".submitit").glob("*/*_log.out"))
    assert len(task_logs) == 2, task_logs  # two SLURM (array) jobs, not two processes of one


# A 2-task job (srun starts two tasks; forge.parallel.env reads SLURM_PROCID/NTASKS; FSDP over both) trains the
# one-process curve: tests/parallel/test_any_world.py; the sbatch templates with DDP: tests/launch/test_sbatch.py.


def test_job_size_that_misfits_the_plan_is_rejected_before_submission(tmp_path):
    cmd = forge_cmd(
        "-m", LOCAL_SLURM, "hydra.launcher.tasks_per_node=2", "parallel=single", f"hydra.sweep.dir={tmp_path}"
    )
    proc = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 2, proc.stdout + proc.stderr
    assert "hydra.launcher.nodes=1 x hydra.launcher.tasks_per_node=2 = 2 processes" in proc.stderr
    assert "does not equal the world size 2" in proc.stderr
    assert slurm_job_ids(tmp_path) == []


def test_preempted_job_is_requeued_and_resumes_to_the_same_final_loss(slurm, tmp_path):
    steps = ("train.steps=40", "checkpoint.interval=5")
    reference_dir = tmp_path / "reference"
    ref = subprocess.run(
        forge_cmd(*tiny(*steps), f"hydra.run.dir={reference_dir}"), cwd=ROOT, capture_output=True, text=True,
        timeout=300,
    )  # fmt: skip
    assert ref.returncode == 0, ref.stdout + ref.stderr
    reference = losses(reference_dir)

    sweep_dir = tmp_path / "sweep"
    proc = start_sweep(sweep_dir, LOCAL_SLURM, "hydra.launcher.max_num_timeout=1", *tiny(*steps))
    run_dir = sweep_dir / "0"
    wait_for_step(run_dir, 4, proc)
    (job,) = slurm_job_ids(sweep_dir)
    subprocess.run(["scancel", "--signal=USR2", job], check=True)
    code, out = finish_sweep(proc, sweep_dir)
    assert code == 0, out

    log = (run_dir / "forge.log").read_text()
    assert "preempted (SIGUSR2)" in log and "requeueing the job" in log, log[-3000:]
    assert "resumed from" in log, log[-3000:]
    assert losses(run_dir) == reference
    # slurmdbd records the end of the requeued job a moment after the sweep returns
    deadline = time.monotonic() + 60
    while True:
        states = subprocess.run(["sacct", "-n", "-X", "-D", "-j", job, "-o", "State"], capture_output=True, text=True)
        if states.stdout.split() != ["REQUEUED", "RUNNING"] or time.monotonic() > deadline:
            break
        time.sleep(1)
    assert states.stdout.split() == ["REQUEUED", "COMPLETED"], states.stdout


def test_no_requeue_is_left_when_max_num_timeout_is_spent(slurm, tmp_path):
    """max_num_timeout=0: the preempted job checkpoints but is not requeued, and the sweep reports the failure."""
    proc = start_sweep(tmp_path, LOCAL_SLURM, "hydra.launcher.max_num_timeout=0", *tiny("train.steps=40"))
    wait_for_step(tmp_path / "0", 4, proc)
    (job,) = slurm_job_ids(tmp_path)
    subprocess.run(["scancel", "--signal=USR2", job], check=True)
    code, out = finish_sweep(proc, tmp_path)
    assert code != 0
    assert "Job not requeued because: timed-out too many times" in out, out[-3000:]
    assert "resumed from" not in (tmp_path / "0" / "forge.log").read_text()
    assert max(losses(tmp_path / "0")) < 40


def test_an_optuna_search_sends_its_trials_as_slurm_jobs_two_at_a_time(slurm, tmp_path):
    code, out = sweep(tmp_path, LOCAL_SLURM, "hparams_search=lr_optuna", "hydra.sweeper.n_trials=4",
                      "hydra.sweeper.n_jobs=2", *tiny("train.steps=3", "checkpoint.interval=0"))  # fmt: skip
    assert code == 0, out[-3000:]
    arrays = [job for job in slurm_job_ids(tmp_path) if "_" not in job]  # an array's tasks are <array>_<i>
    assert len(arrays) == 2, slurm_job_ids(tmp_path)  # two batches of two trials: two array jobs
    val = {n: read_point(tmp_path / str(n)).val_loss for n in range(4)}
    best = yaml.safe_load((tmp_path / "optimization_results.yaml").read_text())
    assert None not in val.values() and best["best_value"] == min(val.values()), (val, best)
    lrs = {yaml.safe_load((tmp_path / str(n) / ".hydra" / "config.yaml").read_text())["optimizer"]["lr"] for n in val}
    assert len(lrs) == 4
    report = subprocess.run([sys.executable, "-m", "forge.launch.sweep_report", str(tmp_path)], capture_output=True,
                            text=True, timeout=120)  # fmt: skip
    assert report.returncode == 0, report.stderr
    rows = list(csv.DictReader((tmp_path / "sweep_report.csv").open()))
    assert [float(r["val_loss"]) for r in rows] == sorted(val.values())  # ranked by validation loss


def test_a_refused_point_of_a_slurm_sweep_is_recorded_and_the_others_run(slurm, tmp_path):
    code, out = sweep(tmp_path, LOCAL_SLURM, *tiny("train.steps=2", "checkpoint.interval=0"), "optimizer.lr=-1,1e-3")
    assert code == 2, out[-3000:]  # as the refused point alone would
    assert "Traceback" not in out, out[-3000:]
    refused, trained = read_point(tmp_path / "0"), read_point(tmp_path / "1")
    assert refused.status == "refused: optimizer.lr=-1.0 must be > 0", refused
    assert trained.status == "done" and trained.val_loss is not None, trained


def test_local_multirun_without_slurm_keeps_working(tmp_path):
    """Hydra's basic launcher: the same sweep syntax runs the points one after another in this process."""
    proc = subprocess.run(
        forge_cmd("-m", *tiny("train.steps=2"), "optimizer.lr=1e-3,3e-3", f"hydra.sweep.dir={tmp_path}"),
        cwd=ROOT, capture_output=True, text=True, timeout=300,
    )  # fmt: skip
    assert proc.returncode == 0, proc.stdout + proc.stderr
    curves = [losses(tmp_path / str(n)) for n in (0, 1)]
    assert all(sorted(curve) == [1, 2] for curve in curves), curves
    assert curves[0][2] != curves[1][2]
    assert not (tmp_path / ".submitit").exists()
