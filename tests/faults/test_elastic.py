"""Elastic restarts under torchrun's agent: a killed rank makes the agent restart the group, which resumes from the
run directory's latest checkpoint by itself; a node gone makes the group smaller, and the same global batch goes on
over the ranks left (more micro-batches each: "one config, any world")."""

import math
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from tests.conftest import ROOT
from tests.faults.conftest import RUN, finish, losses, wait_for_step
from tests.faults.ranks import start_torchrun, worker_pid
from tests.parallel.harness import free_port

pytestmark = [pytest.mark.slow, pytest.mark.dist]

STEPS = 16
KILL_AFTER = 7  # RUN checkpoints every 2 steps: the restarted group resumes from step 6
LAYOUT_RTOL = 1e-4
"""fp32: one rank summing two micro-batches against two ranks summing one each differs in the reduction order only."""


@pytest.fixture(scope="module")
def reference(tmp_path_factory) -> dict[int, float]:
    """The uninterrupted two-rank curve."""
    run_dir = tmp_path_factory.mktemp("elastic_reference")
    code, out = finish(start_torchrun(run_dir, f"train.steps={STEPS}"))
    assert code == 0, out[-3000:]
    return losses(run_dir)


def test_a_killed_rank_is_restarted_in_place_and_the_curve_is_bitwise(tmp_path, reference):
    launcher = start_torchrun(tmp_path, f"train.steps={STEPS}", torchrun_args=("--max-restarts=1",))
    wait_for_step(launcher, tmp_path, KILL_AFTER)
    os.kill(worker_pid(launcher, 1), signal.SIGKILL)
    code, out = finish(launcher)
    assert code == 0, out[-3000:]
    assert "rank 0: a collective failed at step" in out  # the survivor ended the attempt (exit 77) ...
    assert "resumed from" in out and "Gloo connectFullMesh failed" not in out, out[-3000:]  # ... the next resumed
    assert losses(tmp_path) == reference


def start_node(run_dir: Path, port: int, log: Path, nnodes: str = "1:2", env: dict | None = None) -> subprocess.Popen:
    """One "node" of an elastic job of 1 to 2 nodes (`nnodes`), one rank each, meeting at a c10d rendezvous on
    `port`. A node that stops heartbeating is dropped from the next round within ~2 s (the defaults take ~45 s); a
    round waits 5 s for more nodes once it has one, so both nodes join the first (a node joining a running job
    restarts it)."""
    cmd = [sys.executable, "-m", "torch.distributed.run", f"--nnodes={nnodes}", "--nproc_per_node=1",
           "--max-restarts=1", "--rdzv-backend=c10d", f"--rdzv-endpoint=127.0.0.1:{port}", "--rdzv-id=elastic-test",
           "--rdzv-conf=keep_alive_interval=1,keep_alive_max_attempt=2,last_call_timeout=5",
           "-m", "forge.train", *RUN, "parallel=fsdp", f"train.steps={STEPS}", f"hydra.run.dir={run_dir}"]  # fmt: skip
    return subprocess.Popen(cmd, cwd=ROOT, stdout=log.open("w"), stderr=subprocess.STDOUT,
                            env={**os.environ, "PYTHONUNBUFFERED": "1", **(env or {})})  # fmt: skip


def test_a_two_node_job_restarts_in_place_and_the_curve_is_bitwise(tmp_path, reference):
    """Each node's agent restarts its rank; with TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1 each rendezvous round gets a
    fresh store, so the new group reads none of the last one's addresses (with the agents' shared store it hung)."""
    run_dir, port = tmp_path / "run", free_port()
    fresh = {"TORCH_DISABLE_SHARE_RDZV_TCP_STORE": "1"}
    nodes = [start_node(run_dir, port, tmp_path / "node0.log", "2", fresh)]
    time.sleep(0.5)  # the first node hosts the rendezvous store
    nodes.append(start_node(run_dir, port, tmp_path / "node1.log", "2", fresh))
    try:
        wait_for_step(nodes[0], run_dir, KILL_AFTER)
        victim = next(pid for node in nodes for pid in [rank_pid(node, 1)] if pid is not None)
        os.kill(victim, signal.SIGKILL)
        for k, node in enumerate(nodes):
            assert node.wait(timeout=180) == 0, (tmp_path / f"node{k}.log").read_text()[-3000:]
    finally:
        for node in nodes:
            if node.poll() is None:
                node.kill()
    assert "resumed from" in (run_dir / "forge.log").read_text()
    assert losses(run_dir) == reference


def rank_pid(launcher: subprocess.Popen, rank: int) -> int | None:
    try:
        return worker_pid(launcher, rank)
    except AssertionError:  # not this node's rank
        return None


def test_a_node_gone_leaves_one_rank_that_goes_on_with_the_same_global_batch(tmp_path, reference):
    run_dir, port = tmp_path / "run", free_port()
    first = start_node(run_dir, port, tmp_path / "node0.log")
    time.sleep(0.5)  # the first node hosts the rendezvous store
    second = start_node(run_dir, port, tmp_path / "node1.log")
    try:
        wait_for_step(first, run_dir, KILL_AFTER)
        kill_node(second)
        assert first.wait(timeout=180) == 0, (tmp_path / "node0.log").read_text()[-3000:]
    finally:
        for node in (first, second):
            if node.poll() is None:
                node.kill()
    log = (run_dir / "forge.log").read_text()  # rank 0's, whichever node held it
    assert "FSDP over mesh {'dp_shard': 2}" in log and "grad accum 1" in log  # two ranks first ...
    resumed = log[log.index("resumed from") :]
    assert "grad accum 2" in resumed and "FSDP over mesh" not in resumed  # ... then one, with two micro-batches
    curve = losses(run_dir)
    assert sorted(curve) == list(range(1, STEPS + 1))
    for step, loss in curve.items():
        if step <= 6:
            assert loss == reference[step], step  # trained by the two ranks before the loss
        else:
            assert math.isclose(loss, reference[step], rel_tol=LAYOUT_RTOL), (step, loss, reference[step])


def kill_node(launcher: subprocess.Popen) -> None:
    """SIGKILL a node's rank (0 or 1, as the rendezvous ordered the nodes) and its agent."""
    for rank in (0, 1):
        try:
            os.kill(worker_pid(launcher, rank), signal.SIGKILL)
        except AssertionError:  # not this node's rank
            continue
    launcher.kill()
