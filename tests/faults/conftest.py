"""Fault injection against real training subprocesses.

FORGE_FAULT_KILLS sets how many random SIGKILLs the kill test injects (default 3; e.g. 300 for a long soak).
"""

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

from tests.conftest import ROOT
from tests.tiny import TINY_MODEL, losses

RUN = [
    *TINY_MODEL,
    "train.seq_len=32",
    "train.global_batch_size=4",
    "train.micro_batch_size=2",
    "train.dtype=fp32",
    "train.log_every=1",
    "train.eval_every=0",
    "train.eval_batches=1",
    "scheduler.warmup_steps=2",
    "train.steps=16",
    "checkpoint.interval=2",
    "train.threads=1",
]


def start(run_dir: Path, *overrides: str) -> subprocess.Popen:
    return subprocess.Popen(
        [sys.executable, "-m", "forge.train", *RUN, *overrides, f"hydra.run.dir={run_dir}"],
        cwd=ROOT,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        env={**os.environ, "PYTHONUNBUFFERED": "1"},
    )


def finish(proc: subprocess.Popen, timeout: float = 300) -> tuple[int, str]:
    out, _ = proc.communicate(timeout=timeout)
    return proc.returncode, out


def train(run_dir: Path, *overrides: str) -> tuple[int, str]:
    return finish(start(run_dir, *overrides))


def wait_for_step(proc: subprocess.Popen, run_dir: Path, step: int, timeout: float = 120) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline and proc.poll() is None:
        if max(losses(run_dir), default=0) >= step:
            return
        time.sleep(0.05)
    raise AssertionError(f"run never reached step {step}")


def kill(proc: subprocess.Popen, sig: int = signal.SIGKILL) -> None:
    proc.send_signal(sig)
