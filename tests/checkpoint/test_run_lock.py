"""One job per run directory: a second job waits for the first or is refused, naming the holder; a refused job
(lock, or a resume that changes the model) leaves the run's `.hydra/` record as it was."""

import os
import signal
import subprocess
import sys
import time

import pytest

from forge.checkpoint import CheckpointError
from forge.checkpoint.run_lock import LOCK_NAME, hold_run_dir
from tests.conftest import forge_cmd
from tests.parallel.harness import launch
from tests.tiny import TINY_MODEL

HOLD = (
    "import sys; from pathlib import Path; from forge.checkpoint.run_lock import RunDirLock; "
    "assert RunDirLock(Path(sys.argv[1])).try_acquire(); print('held', flush=True); sys.stdin.read()"
)
"""Another process that holds the lock until its stdin is closed."""

RUN = [
    *TINY_MODEL,
    "train.steps=1",
    "train.seq_len=32",
    "train.global_batch_size=2",
    "train.eval_batches=1",
    "checkpoint.interval=1",
    "scheduler.warmup_steps=0",
]


def start_holder(run_dir) -> subprocess.Popen:
    run_dir.mkdir(parents=True, exist_ok=True)
    holder = subprocess.Popen(
        [sys.executable, "-c", HOLD, str(run_dir / LOCK_NAME)], stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True
    )
    assert holder.stdout.readline().strip() == "held"
    return holder


def test_a_held_run_dir_is_refused_naming_the_holder_or_waited_for(tmp_path):
    holder = start_holder(tmp_path)
    try:
        with pytest.raises(CheckpointError, match=rf"in use by host \S+ pid {holder.pid} since .*run_lock=wait"):
            hold_run_dir(tmp_path, "refuse", 600)
        started = time.monotonic()
        with pytest.raises(CheckpointError, match=r"pid .* a longer checkpoint.run_lock_timeout_s \(waited 0.5s\)"):
            hold_run_dir(tmp_path, "wait", 0.5, poll_s=0.1)
        assert time.monotonic() - started >= 0.5
        assert hold_run_dir(tmp_path, "off", 0) is None
    finally:
        holder.stdin.close()
        holder.wait()
    lock = hold_run_dir(tmp_path, "refuse", 0)  # released with the holder's process
    assert f"pid={os.getpid()} " in (tmp_path / LOCK_NAME).read_text()
    lock.release()


def _two_ranks_wait(run_dir):
    lock = hold_run_dir(run_dir, "wait", 120, poll_s=0.1)
    return lock is not None


def test_two_ranks_wait_together_and_rank_0_holds_the_lock(tmp_path):
    holder = start_holder(tmp_path)
    releaser = subprocess.Popen([sys.executable, "-c", f"import time, os; time.sleep(2); os.kill({holder.pid}, 15)"])
    try:
        assert launch(_two_ranks_wait, 2, tmp_path, timeout=120) == [True, False]
    finally:
        releaser.wait()
        holder.kill()
        holder.wait()


def test_a_second_job_waits_for_the_first_and_a_refused_resume_keeps_the_record(tmp_path):
    run_dir = tmp_path / "run"
    holder = start_holder(run_dir)
    job = subprocess.Popen(forge_cmd(*RUN, f"hydra.run.dir={run_dir}"), stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    try:
        deadline = time.monotonic() + 120
        log = run_dir / "forge.log"
        while "waiting up to 600s" not in (log.read_text() if log.is_file() else ""):
            assert job.poll() is None and time.monotonic() < deadline, job.communicate()
            time.sleep(0.2)
        assert not (run_dir / ".hydra").exists()  # nothing of its own written while another job has the folder
    finally:
        holder.send_signal(signal.SIGTERM)
        holder.wait()
    out, err = job.communicate(timeout=300)
    assert job.returncode == 0, err.decode()[-2000:]
    record = {name: (run_dir / ".hydra" / name).read_bytes() for name in ("config.yaml", "overrides.yaml")}
    assert b"checkpoint.interval=1" in record["overrides.yaml"]

    refused = subprocess.run(
        forge_cmd(*RUN, f"hydra.run.dir={run_dir}", "train.steps=2", "model.rope_theta=5000"),
        capture_output=True,
        text=True,
    )
    assert refused.returncode == 1
    assert "model.rope_theta=5000.0 (was 10000.0)" in refused.stderr and "Traceback" not in refused.stderr
    assert {name: (run_dir / ".hydra" / name).read_bytes() for name in record} == record


def test_an_empty_run_dir_is_refused_and_writes_nothing(tmp_path):
    result = subprocess.run(forge_cmd("hydra.run.dir="), cwd=tmp_path, capture_output=True, text=True)
    assert result.returncode == 2
    assert "hydra.run.dir is empty" in result.stderr and "Traceback" not in result.stderr
    assert list(tmp_path.iterdir()) == []
