"""A real single-node SLURM for the launch tests, and helpers that drive `forge-train -m` sweeps against it.

The session fixture runs launchers/local-slurm/start-slurm.sh (installs the Debian packages on first use, as root)
and stops the daemons again afterwards, unless a cluster was already up before the session (then it is left alone).
"""

import os
import shutil
import signal
import subprocess
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.conftest import ROOT, forge_cmd
from tests.faults.conftest import RUN
from tests.tiny import losses  # noqa: F401 - re-exported for the launch tests

SCRIPTS = ROOT / "launchers" / "local-slurm"
START_TIMEOUT_S = 600


def _cluster_up() -> bool:
    if not shutil.which("scontrol") or not shutil.which("sinfo"):
        return False
    ping = subprocess.run(["scontrol", "ping"], capture_output=True, text=True)
    state = subprocess.run(["sinfo", "-h", "-N", "-o", "%N %T"], capture_output=True, text=True)
    one_node = state.stdout.split() in (["localhost", s] for s in ("idle", "mixed", "allocated"))
    return ping.returncode == 0 and "UP" in ping.stdout and one_node  # not a cluster of SLURM_CI_NODES > 1


@pytest.fixture(scope="session")
def slurm() -> Iterator[None]:
    """A running slurmctld + slurmd (+ slurmdbd, so submitit can poll sacct) for the whole session."""
    if _cluster_up():
        yield
        return
    if os.geteuid() != 0:
        pytest.skip("SLURM cannot be installed: start-slurm.sh needs root")
    if not shutil.which("apt-get") and not shutil.which("slurmctld"):
        pytest.skip("SLURM cannot be installed: no apt-get (Debian/Ubuntu) and no slurmctld on PATH")
    start = start_cluster(nodes=1)  # the tests' one node of 2 CPUs, whatever SLURM_CI_NODES the shell exported
    if start.returncode != 0:
        output = (start.stdout + start.stderr)[-3000:]
        if not shutil.which("slurmctld"):
            pytest.skip(f"SLURM cannot be installed here (apt-get failed):\n{output}")
        pytest.fail(f"start-slurm.sh failed:\n{output}")
    try:
        yield
    finally:
        subprocess.run(["bash", str(SCRIPTS / "stop-slurm.sh")], capture_output=True, text=True, timeout=120)


def start_cluster(nodes: int) -> subprocess.CompletedProcess:
    """(Re)start the local cluster as `nodes` slurmd daemons (start-slurm.sh stops the ones it started before)."""
    return subprocess.run(
        ["bash", str(SCRIPTS / "start-slurm.sh")],
        env={**os.environ, "SLURM_CI_NODES": str(nodes)},
        capture_output=True,
        text=True,
        timeout=START_TIMEOUT_S,
    )


@pytest.fixture(scope="module")
def two_nodes(slurm) -> Iterator[list[str]]:
    """The local cluster as two nodes, n1 and n2 (a slurmd each, one CPU each), for one module; one node after it."""
    try:
        start = start_cluster(nodes=2)
        assert start.returncode == 0, (start.stdout + start.stderr)[-3000:]
        yield ["n1", "n2"]
    finally:
        back = start_cluster(nodes=1)  # the other SLURM modules' one node of 2 CPUs
        if back.returncode != 0:
            subprocess.run(["bash", str(SCRIPTS / "stop-slurm.sh")], capture_output=True, text=True, timeout=120)
        assert back.returncode == 0, (back.stdout + back.stderr)[-3000:]


def tiny(*overrides: str) -> list[str]:
    """The fault tests' tiny model and schedule, plus overrides."""
    return [*RUN, *overrides]


def slurm_job_ids(sweep_dir: Path) -> list[str]:
    """SLURM job ids of a sweep: submitit's folder per job (`.submitit/%j`; an array's tasks share one)."""
    folder = sweep_dir / ".submitit"
    return sorted(p.name for p in folder.iterdir() if p.is_dir()) if folder.is_dir() else []


def start_sweep(sweep_dir: Path, *overrides: str) -> subprocess.Popen:
    return subprocess.Popen(
        forge_cmd("-m", *overrides, f"hydra.sweep.dir={sweep_dir}"),
        cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
        env={**os.environ, "PYTHONUNBUFFERED": "1"},
    )  # fmt: skip


def finish_sweep(proc: subprocess.Popen, sweep_dir: Path, timeout: float = 300) -> tuple[int, str]:
    """Wait for the submitting process; on a deadline cancel the sweep's jobs (submitit's result() never times out)."""
    try:
        out, _ = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        for job in slurm_job_ids(sweep_dir):
            subprocess.run(["scancel", job], check=False)
        proc.send_signal(signal.SIGINT)
        out, _ = proc.communicate(timeout=30)
        pytest.fail(f"sweep did not finish within {timeout:.0f} s:\n{out[-3000:]}")
    return proc.returncode, out


def sweep(sweep_dir: Path, *overrides: str, timeout: float = 300) -> tuple[int, str]:
    return finish_sweep(start_sweep(sweep_dir, *overrides), sweep_dir, timeout)


def wait_for_step(run_dir: Path, step: int, proc: subprocess.Popen, timeout: float = 180) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline and proc.poll() is None:
        if max(losses(run_dir), default=0) >= step:
            return
        time.sleep(0.05)
    raise AssertionError(f"{run_dir} never reached step {step}")
