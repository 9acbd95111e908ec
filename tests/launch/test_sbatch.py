"""The plain sbatch templates in launchers/: one task per process, or torchrun per node; same ranks, same losses."""

import os
import subprocess
import sys
import time

import pytest

from tests.conftest import ROOT
from tests.launch.conftest import losses, tiny

pytestmark = [pytest.mark.slow, pytest.mark.dist]

# this machine: no GPU, 2 CPUs; command-line options override the templates' #SBATCH lines
LOCAL = ["--gpus-per-node=0", "--time=5"]


def run_sbatch(template: str, run_dir, *options: str, env: dict[str, str], timeout: float = 240) -> str:
    """Submit, wait for the job to leave the queue (cancelled at the deadline), return its final state."""
    env = {"FORGE_PYTHON": sys.executable, "FORGE_RUN_DIR": str(run_dir), **env}
    job = subprocess.run(
        ["sbatch", "--parsable", *LOCAL, *options, f"--output={run_dir}.out", f"launchers/{template}",
         "parallel=ddp", *tiny("train.steps=3")],
        cwd=ROOT, capture_output=True, text=True, check=True, env={**os.environ, **env},
    ).stdout.strip()  # fmt: skip
    deadline = time.monotonic() + timeout
    while subprocess.run(["squeue", "-h", "-j", job], capture_output=True, text=True).stdout.strip():
        if time.monotonic() > deadline:
            subprocess.run(["scancel", job])
            pytest.fail(f"sbatch job {job} did not finish in {timeout:.0f} s")
        time.sleep(0.5)
    # slurmdbd records the job's end a moment after it leaves the queue
    settle = time.monotonic() + 60
    while True:
        state = subprocess.run(["sacct", "-n", "-X", "-j", job, "-o", "State"], capture_output=True, text=True)
        if state.stdout.strip() not in ("RUNNING", "PENDING", "") or time.monotonic() > settle:
            return state.stdout.strip()
        time.sleep(0.5)


def test_sbatch_one_task_per_process_and_torchrun_per_node_agree(slurm, tmp_path):
    tasks_dir, torchrun_dir = tmp_path / "tasks", tmp_path / "torchrun"
    state = run_sbatch("slurm.sbatch", tasks_dir, "--ntasks-per-node=2", "--cpus-per-task=1", env={})
    assert (tasks_dir / "metrics.jsonl").is_file(), (tmp_path / "tasks.out").read_text()[-3000:]
    state2 = run_sbatch("slurm_torchrun.sbatch", torchrun_dir, "--cpus-per-task=2", env={"FORGE_NPROC_PER_NODE": "2"})
    assert (torchrun_dir / "metrics.jsonl").is_file(), (tmp_path / "torchrun.out").read_text()[-3000:]
    for run_dir in (tasks_dir, torchrun_dir):
        assert "'dp_replicate': 2" in (run_dir / "forge.log").read_text()
    assert sorted(losses(tasks_dir)) == [1, 2, 3]
    assert losses(tasks_dir) == losses(torchrun_dir)
    assert (state, state2) == ("COMPLETED", "COMPLETED")
