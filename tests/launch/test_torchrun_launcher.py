"""hydra/launcher=torchrun: each sweep point of a `-m` run is its own torchrun of N processes on this machine."""

import subprocess
import sys
from pathlib import Path

from forge.launch.sweep_report import read_point
from hydra_plugins.forge_torchrun_launcher.torchrun_launcher import job_return

ROOT = Path(__file__).resolve().parents[2]


def test_two_points_of_two_processes_each(tmp_path):
    sweep = tmp_path / "sweep"
    done = subprocess.run(
        [sys.executable, "-m", "forge.train", "-m", "hydra/launcher=torchrun", "hydra.launcher.nproc_per_node=2",
         "optimizer.lr=1e-3,3e-3", "debug=fast", f"hydra.sweep.dir={sweep}"],
        cwd=ROOT, capture_output=True, text=True, timeout=600,
    )  # fmt: skip
    assert done.returncode == 0, done.stderr[-3000:]
    for point, lr in (("0", "0.001"), ("1", "0.003")):
        log = (sweep / point / "forge.log").read_text()
        assert "FSDP over mesh {'dp_shard': 2}" in log  # two processes, not one
        assert f"optimizer.lr={lr}" in (sweep / point / ".hydra" / "overrides.yaml").read_text()
        row = read_point(sweep / point)
        assert row.status == "done"
        assert job_return([f"optimizer.lr={lr}"], sweep / point, 0).return_value == row.val_loss


def test_a_failed_point_is_a_failed_job(tmp_path):
    ret = job_return(["optimizer.lr=1"], tmp_path, 1)
    assert ret.status.name == "FAILED"
