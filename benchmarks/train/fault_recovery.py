"""The work a lost rank costs, side by side for each way a job recovers: steps trained again, and seconds from the
kill to the next new step.

    .venv/bin/python benchmarks/train/fault_recovery.py [--rounds 3] [--kill-after 7] [--interval 2] [--modes ...]

Two gloo ranks train the fault tests' tiny model (fp32, one micro-batch of 2 each); rank 1 is SIGKILLed once the
run has logged step --kill-after (checkpoints every --interval steps). Modes:
  requeue   the job ends (the survivor names the lost rank, exit 77); the same torchrun command is started again at
            once, as a scheduler's requeue would after its queue wait (not counted here)
  in_place  torchrun --max-restarts=1: the agent restarts the group, which resumes by itself
  shrink    an elastic job of 1-2 nodes (one rank each, c10d rendezvous) loses a node: its rank and its agent; the
            rank left goes on with the same global batch
  torchft   two replica groups of one rank (forge.launch.replica_groups); group 1's rank is killed: group 0 steps on
            alone and group 1 restarts and takes its state (steps trained again: the updates group 0 dropped, each
            step then trained again with the next batches)
Steps trained again: the last step logged before the kill minus the step the next attempt resumed from. Seconds:
from the kill to the first step logged after it that the last attempt had not reached (under torchft: group 0's
next step, and in brackets until group 1 trains again). Medians over --rounds.

Last result (2 CPUs, avx512_bf16, --rounds 3): 1 step trained again in each mode but torchft (0); requeue 6.8 s,
in place 4.5 s, shrink 10.6 s, torchft 2.1 s (the lighthouse's 2 s heartbeat timeout; group 1 trains again 3.9 s
after the kill).
"""

import argparse
import json
import os
import signal
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))  # the checkout, for benchmarks.machine

from benchmarks.machine import ROOT, cpu_flags  # noqa: E402

TINY = ["model.dim=64", "model.n_layers=2", "model.n_heads=4", "model.n_kv_heads=2", "model.ffn_dim=128",
        "train.seq_len=32", "train.global_batch_size=4", "train.micro_batch_size=2", "train.dtype=fp32",
        "train.log_every=1", "train.eval_every=0", "train.eval_batches=1", "scheduler.warmup_steps=2",
        "train.threads=1", "parallel=fsdp"]  # fmt: skip
TORCHRUN = [sys.executable, "-m", "torch.distributed.run"]


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def steps_logged(run_dir: Path) -> list[int]:
    path = run_dir / "metrics.jsonl"
    lines = path.read_text().splitlines() if path.is_file() else []
    return [json.loads(line)["step"] for line in lines if line.endswith("}") and '"loss"' in line]


def worker_pids(launcher: subprocess.Popen) -> dict[int, int]:
    """RANK -> pid of the launcher's worker processes."""
    pids = {}
    for entry in Path("/proc").iterdir():
        try:
            ppid = int((entry / "stat").read_text().rsplit(")", 1)[1].split()[1])
            environ = (entry / "environ").read_bytes().split(b"\0")
        except (OSError, IndexError, ValueError):
            continue
        if ppid == launcher.pid:
            ranks = [int(v[5:]) for v in environ if v.startswith(b"RANK=")]
            pids.update({ranks[0]: int(entry.name)} if ranks else {})
    return pids


def launch(run_dir: Path, steps: int, interval: int, *torchrun_args: str, log: Path) -> subprocess.Popen:
    cmd = [*TORCHRUN, *torchrun_args, "-m", "forge.train", *TINY, f"train.steps={steps}",
           f"checkpoint.interval={interval}", f"hydra.run.dir={run_dir}"]  # fmt: skip
    return subprocess.Popen(cmd, cwd=ROOT, stdout=log.open("a"), stderr=subprocess.STDOUT)


def wait_for(condition, timeout: float = 300) -> None:
    deadline = time.monotonic() + timeout
    while not condition():
        if time.monotonic() > deadline:
            raise TimeoutError("the run did not get there")
        time.sleep(0.02)


def records(run_dir: Path) -> list[dict]:
    path = run_dir / "metrics.jsonl"
    lines = path.read_text().splitlines() if path.is_file() else []
    return [json.loads(line) for line in lines if line.endswith("}") and '"loss"' in line]


def replica_round(kill_after: int, interval: int) -> tuple[int, float, float]:
    """Two replica groups; group 1's rank killed once both trained past kill_after together."""
    run_dir = Path(tempfile.mkdtemp(prefix="recovery_torchft_"))
    log = run_dir.parent / f"{run_dir.name}.log"
    overrides = [*TINY[:-1], "train.steps=600", f"checkpoint.interval={interval}"]
    cmd = [sys.executable, "-m", "forge.launch.replica_groups", "--groups=2", "--max-restarts=1",
           f"--run-dir={run_dir}", "--", *overrides]  # fmt: skip
    launcher = subprocess.Popen(cmd, cwd=ROOT, stdout=log.open("a"), stderr=subprocess.STDOUT)
    group0, group1 = run_dir / "replica_0", run_dir / "replica_1"

    def together_past(step: int) -> bool:
        last = [records(group)[-1:] for group in (group0, group1)]
        return all(r and r[0]["step"] >= step and r[0]["replica_groups"] == 2 for r in last)

    wait_for(lambda: together_past(kill_after))
    reached = records(group0)[-1]["step"]
    killed_at = time.monotonic()
    victim = [pid for pid in Path("/proc").iterdir() if pid.name.isdigit() and is_worker_of_group(pid, 1)]
    os.kill(int(victim[0].name), signal.SIGKILL)
    seen = len(records(group1))
    wait_for(lambda: records(group0)[-1]["step"] > reached + 1)  # the step in flight may be dropped
    seconds = time.monotonic() - killed_at
    wait_for(lambda: len(records(group1)) > seen)
    rejoin = time.monotonic() - killed_at
    assert launcher.wait(timeout=300) == 0, log.read_text()[-3000:]
    return records(group0)[-1]["dropped_steps"], seconds, rejoin


def is_worker_of_group(proc: Path, group: int) -> bool:
    try:
        cmdline = (proc / "cmdline").read_bytes().split(b"\0")
        environ = (proc / "environ").read_bytes().split(b"\0")
    except OSError:
        return False
    return f"resilience.ft_replica_id={group}".encode() in cmdline and any(v.startswith(b"RANK=") for v in environ)


def one_round(mode: str, kill_after: int, interval: int, steps: int) -> tuple[int, float]:
    run_dir = Path(tempfile.mkdtemp(prefix=f"recovery_{mode}_"))
    log = run_dir.parent / f"{run_dir.name}.log"
    standalone = ("--standalone", "--nproc_per_node=2")
    if mode == "shrink":
        port = free_port()
        node = ("--nnodes=1:2", "--nproc_per_node=1", "--max-restarts=1", "--rdzv-backend=c10d",
                f"--rdzv-endpoint=127.0.0.1:{port}", f"--rdzv-id={run_dir.name}",
                "--rdzv-conf=keep_alive_interval=1,keep_alive_max_attempt=2,last_call_timeout=5")  # fmt: skip
        first = launch(run_dir, steps, interval, *node, log=log)
        time.sleep(0.5)  # the first node hosts the rendezvous store; the second is the one lost
        victim = launch(run_dir, steps, interval, *node, log=log)
    else:
        first = victim = launch(run_dir, steps, interval, *standalone,
                                *(("--max-restarts=1",) if mode == "in_place" else ()), log=log)  # fmt: skip
    wait_for(lambda: max(steps_logged(run_dir), default=0) >= kill_after)
    reached = max(steps_logged(run_dir))
    killed_at = time.monotonic()
    pids = worker_pids(victim)
    os.kill(pids[1] if mode != "shrink" else next(iter(pids.values())), signal.SIGKILL)
    if mode == "shrink":
        victim.kill()
    elif mode == "requeue":
        first.wait(timeout=300)
        first = launch(run_dir, steps, interval, *standalone, log=log)
    seen = len(steps_logged(run_dir))
    wait_for(lambda: any(s > reached for s in steps_logged(run_dir)[seen:]))
    seconds = time.monotonic() - killed_at
    code = first.wait(timeout=300)
    assert code == 0, log.read_text()[-3000:]
    resumed = [line for line in (run_dir / "forge.log").read_text().splitlines() if "resumed from" in line]
    resumed_step = int(resumed[-1].split(" at step ")[1]) if resumed else 0
    return reached - resumed_step, seconds


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--kill-after", type=int, default=7)
    parser.add_argument("--interval", type=int, default=2)
    parser.add_argument("--steps", type=int, default=16)
    parser.add_argument("--modes", default="requeue,in_place,shrink,torchft", help="comma-separated")
    args = parser.parse_args()
    print(f"CPU flags: {cpu_flags()} | {os.cpu_count()} CPUs | kill after step {args.kill_after}, checkpoints "
          f"every {args.interval} steps, {args.rounds} rounds")  # fmt: skip
    print(f"{'mode':<10} {'steps trained again':>20} {'s from kill to a new step':>27}")
    for mode in args.modes.split(","):
        if mode == "torchft":
            results = [replica_round(args.kill_after, args.interval) for _ in range(args.rounds)]
        else:
            results = [one_round(mode, args.kill_after, args.interval, args.steps) for _ in range(args.rounds)]
        lost = statistics.median(r[0] for r in results)
        seconds = statistics.median(r[1] for r in results)
        rejoin = f" ({statistics.median(r[2] for r in results):.1f} to rejoin)" if mode == "torchft" else ""
        print(f"{mode:<10} {lost:>20.0f} {seconds:>27.1f}{rejoin}", flush=True)


if __name__ == "__main__":
    main()
