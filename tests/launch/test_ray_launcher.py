"""Sweep points as tasks on a Ray cluster started here (`ray start --head`), through hydra-ray-launcher
(hydra/launcher=ray_cluster): each point trains in a Ray worker, a refused point is recorded and the others run."""

import csv
import os
import socket
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest
import yaml

from tests.conftest import ROOT, forge_cmd
from tests.launch.conftest import losses, tiny

RAY = str(Path(sys.executable).parent / "ray")
ENV = {**os.environ, "RAY_USAGE_STATS_ENABLED": "0"}


@pytest.fixture
def ray_cluster() -> Iterator[str]:
    """A one-node Ray cluster of 2 CPUs on a free port; its address."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    start = subprocess.run(
        [RAY, "start", "--head", f"--port={port}", "--num-cpus=2", "--object-store-memory=80000000",
         "--include-dashboard=false", "--disable-usage-stats"],
        capture_output=True, text=True, timeout=180, env=ENV,
    )  # fmt: skip
    assert start.returncode == 0, start.stdout[-2000:] + start.stderr[-2000:]
    try:
        yield f"127.0.0.1:{port}"
    finally:
        subprocess.run([RAY, "stop", "--force"], capture_output=True, timeout=120, env=ENV)


def test_a_sweep_runs_its_points_on_a_ray_cluster(ray_cluster, tmp_path):
    sweep = tmp_path / "sweep"
    done = subprocess.run(
        forge_cmd("-m", "hydra/launcher=ray_cluster", f"hydra.launcher.ray.init.address={ray_cluster}",
                  *tiny("train.steps=3", "checkpoint.interval=0"), "optimizer.lr=-1,1e-3,3e-3",
                  f"hydra.sweep.dir={sweep}"),
        cwd=ROOT, capture_output=True, text=True, timeout=600, env=ENV,
    )  # fmt: skip
    out = done.stdout + done.stderr
    assert done.returncode == 2, out[-3000:]  # as the refused point alone would
    assert "Connected to Ray cluster" in out and "Traceback" not in done.stderr, out[-3000:]
    for point in ("1", "2"):  # trained in a Ray worker: the launcher names each job after its index
        hydra_record = yaml.safe_load((sweep / point / ".hydra" / "hydra.yaml").read_text())
        assert hydra_record["hydra"]["job"]["id"] == f"job_id_for_{point}"
        assert sorted(losses(sweep / point)) == [1, 2, 3]
    assert losses(sweep / "1")[3] != losses(sweep / "2")[3]
    report = subprocess.run([sys.executable, "-m", "forge.launch.sweep_report", str(sweep)], capture_output=True,
                            text=True, timeout=120)  # fmt: skip
    assert report.returncode == 0, report.stderr
    status = {row["point"]: row["status"] for row in csv.DictReader((sweep / "sweep_report.csv").open())}
    assert status == {"0": "refused: optimizer.lr=-1.0 must be > 0", "1": "done", "2": "done"}, status
