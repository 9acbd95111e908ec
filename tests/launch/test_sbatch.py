"""The plain sbatch templates in launchers/: one task per process, or torchrun per node; same ranks, same losses."""

import os
import subprocess
import sys
import time

import pytest

from tests.conftest import ROOT, forge_cmd
from tests.launch.conftest import losses, tiny

pytestmark = [pytest.mark.slow, pytest.mark.dist]

# this machine: no GPU, 2 CPUs; command-line options override the templates' #SBATCH lines
LOCAL = ["--gpus-per-node=0", "--time=5"]
REQUEUE_STEPS = 100
"""Long enough that the node fails mid-run (a step of the tiny model takes milliseconds)."""
LAYOUT_RTOL = 1e-4
"""fp32: two ranks summing one micro-batch each against one process summing two differ in the reduction order."""


def submit(template: str, run_dir, *options: str, env: dict[str, str], run: tuple = ("parallel=ddp", "train.steps=3")):
    """sbatch a launchers/ template for the tiny run with `run`'s overrides; its job id."""
    env = {"FORGE_PYTHON": sys.executable, "FORGE_RUN_DIR": str(run_dir), **env}
    return subprocess.run(
        ["sbatch", "--parsable", *LOCAL, *options, f"--output={run_dir}.out", f"launchers/{template}",
         *tiny(*run)],
        cwd=ROOT, capture_output=True, text=True, check=True, env={**os.environ, **env},
    ).stdout.strip()  # fmt: skip


def final_state(job: str, timeout: float = 240) -> str:
    """Wait for the job to leave the queue (cancelled at the deadline), return its final state."""
    deadline = time.monotonic() + timeout
    while job_state(job):
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


def run_sbatch(template: str, run_dir, *options: str, env: dict[str, str]) -> str:
    """Submit, wait for the job to leave the queue, return its final state."""
    return final_state(submit(template, run_dir, *options, env=env))


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


def test_a_job_requeued_after_a_node_failed_resumes_on_the_node_left(two_nodes, tmp_path):
    """A job of two nodes, one rank each (FSDP over 2). Node n2 fails (set DOWN) mid-run; SLURM requeues the job
    (the template's --requeue) and, as an operator would, the test shrinks the pending job to the node left
    (`scontrol update JobId=... NumNodes=1 NumTasks=1 NumCPUs=1`). The requeued job starts on n1 and its one rank
    resumes from the two ranks' last checkpoint with the same global batch (two micro-batches instead of one):
    every step stays on the one-process curve up to the order of the reductions."""
    run = ("parallel=fsdp", f"train.steps={REQUEUE_STEPS}")
    reference_dir, run_dir = tmp_path / "reference", tmp_path / "run"
    ref = subprocess.run(
        forge_cmd(*tiny(*run), f"hydra.run.dir={reference_dir}"),
        cwd=ROOT, capture_output=True, text=True, timeout=300,
    )  # fmt: skip
    assert ref.returncode == 0, ref.stdout[-3000:] + ref.stderr[-3000:]
    reference = losses(reference_dir)

    job = submit("slurm.sbatch", run_dir, "--nodes=2", "--ntasks-per-node=1", "--cpus-per-task=1", env={}, run=run)
    deadline = time.monotonic() + 180
    while max(losses(run_dir), default=0) < 7:
        assert time.monotonic() < deadline and job_state(job), f"job {job} never reached step 7: {output(tmp_path)}"
        time.sleep(0.05)
    down = ["scontrol", "update", f"nodename={two_nodes[1]}", "state=down", "reason=forge-test"]
    subprocess.run(down, check=True, timeout=30)
    assert max(losses(run_dir)) < REQUEUE_STEPS, "the job finished before the node failed"
    while (state := job_state(job)) != "PENDING":  # requeued after the node failure; it waits for two nodes
        assert state and time.monotonic() < deadline, f"job {job} was not requeued ({state!r}): {output(tmp_path)}"
        time.sleep(0.2)
    shrink = ["scontrol", "update", f"jobid={job}", "numnodes=1", "numtasks=1", "numcpus=1"]
    subprocess.run(shrink, check=True, timeout=30)
    state = final_state(job, timeout=300)

    log = (run_dir / "forge.log").read_text()
    assert state == "COMPLETED", (state, output(tmp_path))
    assert "FSDP over mesh {'dp_shard': 2}" in log and "grad accum 1" in log, log[-3000:]  # two ranks first ...
    assert "resumed from" in log, log[-3000:]
    resumed = log[log.index("resumed from") :]
    assert "grad accum 2" in resumed and "FSDP over mesh" not in resumed, resumed[:3000]  # ... then one
    curve = losses(run_dir)
    assert sorted(curve) == sorted(reference) == list(range(1, REQUEUE_STEPS + 1))
    for step, loss in curve.items():
        assert loss == pytest.approx(reference[step], rel=LAYOUT_RTOL), (step, loss, reference[step])


def job_state(job: str) -> str:
    """RUNNING, PENDING, ...; empty once the job left the queue."""
    squeue = ["squeue", "-h", "-j", job, "-o", "%T"]
    return subprocess.run(squeue, capture_output=True, text=True, timeout=30).stdout.strip()


def output(tmp_path) -> str:
    out = tmp_path / "run.out"
    return out.read_text()[-3000:] if out.exists() else "(no output yet)"
