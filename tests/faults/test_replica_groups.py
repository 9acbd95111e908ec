"""Replica groups under torchft (resilience.fault_tolerance=torchft, forge.launch.replica_groups): two groups of one
rank each, on gloo, with torchft's lighthouse. Group 1's rank is SIGKILLed mid-run: group 0 steps on alone with no
restart, torchrun restarts group 1, which takes group 0's state over HTTP (not from disk) and trains with it to
the end; the two groups' final weights are then equal, bit for bit."""

import contextlib
import json
import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
from torch.distributed.checkpoint.format_utils import dcp_to_torch_save

from forge.checkpoint.layout import latest_checkpoint
from tests.conftest import ROOT
from tests.faults.conftest import RUN

pytestmark = [pytest.mark.slow, pytest.mark.dist]

STEPS = 120
KILL_AFTER = 20


def records(run_dir: Path) -> list[dict]:
    path = run_dir / "metrics.jsonl"
    if not path.is_file():
        return []
    lines = path.read_text().splitlines()
    return [json.loads(line) for line in lines if '"loss"' in line and line.endswith("}")]  # not one being written


def both_past(step: int, *run_dirs: Path) -> bool:
    """Each group logged `step` or later, in a quorum of both (the first to start may train alone a few steps and
    the other then joins it by taking its state)."""
    last = [records(run_dir)[-1:] for run_dir in run_dirs]
    return all(r and r[0]["step"] >= step and r[0]["replica_groups"] == 2 for r in last)


def worker_of_group(group: int) -> int:
    """The pid of the forge-train worker of replica group `group` (torchrun's child, with a RANK)."""
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            cmdline = (entry / "cmdline").read_bytes().split(b"\0")
            environ = (entry / "environ").read_bytes().split(b"\0")
        except OSError:
            continue
        if f"resilience.ft_replica_id={group}".encode() in cmdline and any(v.startswith(b"RANK=") for v in environ):
            return int(entry.name)
    raise AssertionError(f"no worker of replica group {group}")


def hold_until_restarted(pid: int, group0: Path, group1: Path, killed_at: int, launcher: subprocess.Popen) -> None:
    """Once group 0 has stepped alone a few steps, stop it (SIGSTOP) until the restarted group 1 waits in its first
    quorum, then let it go on: alone, group 0 would otherwise finish its steps before a loaded machine has restarted
    group 1, which would then find no live group to take the state of."""
    deadline = time.monotonic() + 120
    alone = []
    while launcher.poll() is None and time.monotonic() < deadline and len(alone) < 3:
        alone = [r for r in records(group0) if r["step"] > killed_at and r["replica_groups"] == 1]
        time.sleep(0.01)
    if len(alone) < 3:
        return  # group 1 is back already (or the run ended): the assertions tell which
    try:
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, signal.SIGSTOP)
        while launcher.poll() is None and time.monotonic() < deadline + 120:
            log = (group1 / "forge.log").read_text()
            restarted = log.split(" parameters | ")[2:]  # what the second attempt logged after its model was built
            if restarted and any(s in restarted[-1] for s in ("first quorum; waiting", "took a live group's state")):
                break
            time.sleep(0.05)
    finally:
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, signal.SIGCONT)


def final_weights(run_dir: Path, tmp_path: Path) -> dict[str, torch.Tensor]:
    whole = tmp_path / f"{run_dir.name}.pt"
    dcp_to_torch_save(latest_checkpoint(run_dir / "checkpoints"), whole)
    return torch.load(whole, weights_only=True)["model"]


def test_a_lost_group_restarts_and_takes_a_live_groups_state_while_the_other_steps_on(tmp_path):
    overrides = [*RUN, f"train.steps={STEPS}", "checkpoint.interval=1000"]  # one checkpoint: the last step's
    cmd = [sys.executable, "-m", "forge.launch.replica_groups", "--groups=2", "--max-restarts=1",
           f"--run-dir={tmp_path}", "--", *overrides]  # fmt: skip
    launcher = subprocess.Popen(
        cmd, cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
        env={**os.environ, "PYTHONUNBUFFERED": "1"},
    )  # fmt: skip
    survivor_pid = None
    try:
        group0, group1 = tmp_path / "replica_0", tmp_path / "replica_1"
        deadline = time.monotonic() + 120
        while not both_past(KILL_AFTER, group0, group1) and launcher.poll() is None and time.monotonic() < deadline:
            time.sleep(0.05)
        assert both_past(KILL_AFTER, group0, group1), launcher.communicate(timeout=5)[0][-3000:]
        os.kill(worker_of_group(1), signal.SIGKILL)
        killed_at = records(group0)[-1]["step"]
        survivor_pid = worker_of_group(0)
        hold_until_restarted(survivor_pid, group0, group1, killed_at, launcher)
        out, _ = launcher.communicate(timeout=180)
    finally:
        if survivor_pid:
            with contextlib.suppress(ProcessLookupError):
                os.kill(survivor_pid, signal.SIGCONT)
        if launcher.poll() is None:
            launcher.kill()
    assert launcher.returncode == 0, out[-4000:]

    survivor = {r["step"]: r for r in records(group0)}
    assert len(survivor) == len(records(group0)), "group 0 trained no step twice"
    assert sorted(survivor) == list(range(min(survivor), STEPS + 1)), "group 0 trained every step to the end"
    assert (group0 / "forge.log").read_text().count(" parameters | ") == 1, "group 0 never restarted"
    log1 = (group1 / "forge.log").read_text()  # the restarted attempt's
    took = [line for line in log1.splitlines() if "took a live group's state at step" in line]
    assert len(took) >= 1, log1[-3000:]
    rejoined = int(took[-1].split("at step ")[1].split()[0])
    assert killed_at <= rejoined < STEPS, (killed_at, rejoined)
    alone = [step for step in range(killed_at + 1, rejoined + 1) if survivor[step]["replica_groups"] == 1]
    assert alone == list(range(alone[0], rejoined + 1)), "group 0 stepped on alone while group 1 was down"
    together = [survivor[step]["replica_groups"] for step in range(rejoined + 1, STEPS + 1)]
    assert set(together) == {2}, "and with group 1 from its rejoin on"

    after = {r["step"]: r for r in records(group1) if r["step"] > rejoined}
    assert sorted(after) == list(range(rejoined + 1, STEPS + 1))
    for step in after:  # the same averaged gradients on both groups from the rejoin on
        assert after[step]["grad_norm"] == survivor[step]["grad_norm"], step
    weights0, weights1 = final_weights(group0, tmp_path), final_weights(group1, tmp_path)
    assert weights0.keys() == weights1.keys()
    for name in weights0:
        assert torch.equal(weights0[name], weights1[name]), name


def test_a_refused_config_starts_no_group(tmp_path):
    cmd = [sys.executable, "-m", "forge.launch.replica_groups", "--groups=3", f"--run-dir={tmp_path / 'ft'}", "--",
           "train.global_batch_size=8", "train.micro_batch_size=2"]  # fmt: skip
    result = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert result.returncode == 2 and not (tmp_path / "ft").exists(), result.stderr
    assert result.stderr.strip().splitlines() == [
        "forge.launch.replica_groups: invalid config: train.global_batch_size=8 is not divisible by "
        "train.micro_batch_size=2 x data-parallel ranks=1 x resilience.ft_replicas=3 (leave train.micro_batch_size "
        "unset to split the global batch over the ranks)"
    ]


def launch_groups(run_dir: Path, *overrides: str) -> str:
    cmd = [sys.executable, "-m", "forge.launch.replica_groups", "--groups=2", "--max-restarts=0",
           f"--run-dir={run_dir}", "--", *RUN, *overrides]  # fmt: skip
    result = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stdout[-4000:] + result.stderr[-2000:]
    return result.stdout + result.stderr


def test_groups_resumed_at_different_steps_meet_and_the_one_behind_takes_the_others_state(tmp_path):
    launch_groups(tmp_path, "train.steps=12", "checkpoint.interval=6")
    behind = tmp_path / "replica_1" / "checkpoints"
    shutil.rmtree(behind / "step-00000012")  # group 1's last checkpoint lost: it resumes at step 6, group 0 at 12
    out = launch_groups(tmp_path, "train.steps=16", "checkpoint.interval=6")
    assert "resumed from" in out and "step-00000006 at step 6" in out and "step-00000012 at step 12" in out, out
    assert "replica group 1: took a live group's state at step 12" in out, out[-3000:]
    group0, group1 = (records(tmp_path / f"replica_{k}") for k in (0, 1))
    assert [r["step"] for r in group1[-4:]] == [13, 14, 15, 16] == [r["step"] for r in group0[-4:]]
    assert [r["grad_norm"] for r in group1[-4:]] == [r["grad_norm"] for r in group0[-4:]]  # one state, averaged
    assert all(r["replica_groups"] == 2 for r in group0[-4:])
