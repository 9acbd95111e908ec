"""Launchers for multi-rank faults: forked gloo ranks that may die or hang, and torchrun runs of forge-train.

Unlike tests/parallel/harness.py, `fork_ranks` never joins a barrier at the end (a faulty rank would hang it)
and reports each rank's exit code, so a rank that leaves through os._exit (the resilience code does) is seen.
"""

import datetime
import os
import subprocess
import sys
import traceback
from collections.abc import Callable
from pathlib import Path

import torch.distributed as dist
import torch.multiprocessing as mp

from tests.conftest import ROOT
from tests.faults.conftest import RUN
from tests.parallel.harness import free_port


def _child(fn: Callable, rank: int, world_size: int, port: int, timeout_s: float, queue, args: tuple) -> None:
    code = 0
    try:
        dist.init_process_group(
            "gloo",
            init_method=f"tcp://127.0.0.1:{port}",
            rank=rank,
            world_size=world_size,
            timeout=datetime.timedelta(seconds=timeout_s),
        )
        queue.put((rank, fn(rank, *args)))
    except BaseException:
        queue.put((rank, traceback.format_exc()))
        code = 1
    os._exit(code)


def fork_ranks(fn: Callable, world_size: int, *args, collective_timeout_s: float, join_s: float = 120) -> dict:
    """Run fn(rank, *args) on forked ranks of one gloo group; {rank: (exit code, result or traceback)}."""
    ctx = mp.get_context("fork")
    queue = ctx.SimpleQueue()
    port = free_port()
    procs = [
        ctx.Process(target=_child, args=(fn, r, world_size, port, collective_timeout_s, queue, args))
        for r in range(world_size)
    ]
    for proc in procs:
        proc.start()
    for proc in procs:
        proc.join(join_s)
    for proc in procs:
        if proc.is_alive():
            proc.kill()
            proc.join()
    results: dict[int, object] = {}
    while not queue.empty():
        rank, result = queue.get()
        results[rank] = result
    return {r: (proc.exitcode, results.get(r)) for r, proc in enumerate(procs)}


# Two FSDP ranks over the fault tests' tiny run: one micro-batch of 2 per rank and step, 10 steps.
TWO_RANKS = ["parallel=fsdp", "train.steps=10"]


def start_torchrun(run_dir: Path, *overrides: str, torchrun_args: tuple[str, ...] = ()) -> subprocess.Popen:
    """forge-train on two local ranks under torchrun, output merged into one pipe."""
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2", *torchrun_args, "-m",
           "forge.train"]  # fmt: skip
    return subprocess.Popen(
        [*cmd, *RUN, *TWO_RANKS, *overrides, f"hydra.run.dir={run_dir}"],
        cwd=ROOT,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        env={**os.environ, "PYTHONUNBUFFERED": "1"},
    )


def worker_pid(launcher: subprocess.Popen, rank: int) -> int:
    """The pid of the torchrun worker with this RANK (a child of the launcher)."""
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            ppid = int((entry / "stat").read_text().rsplit(")", 1)[1].split()[1])
            environ = (entry / "environ").read_bytes().split(b"\0")
        except (OSError, IndexError, ValueError):
            continue
        if ppid == launcher.pid and f"RANK={rank}".encode() in environ:
            return int(entry.name)
    raise AssertionError(f"no worker of rank {rank} under torchrun (pid {launcher.pid})")
