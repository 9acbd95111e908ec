"""hydra/launcher=torchrun: each sweep point of a `-m` run is its own torchrun of N processes on this machine."""

import pickle
import subprocess
import sys
from pathlib import Path

from forge.launch.sweep_report import read_point
from hydra_plugins.forge_torchrun_launcher.torchrun_launcher import job_return

ROOT = Path(__file__).resolve().parents[2]


def test_two_points_of_two_processes_each_after_a_refused_one(tmp_path):
    sweep = tmp_path / "sweep"
    command = [sys.executable, "-m", "forge.train", "-m", "hydra/launcher=torchrun", "hydra.launcher.nproc_per_node=2",
               "optimizer.lr=-1,1e-3,3e-3", "debug=fast", f"hydra.sweep.dir={sweep}"]  # fmt: skip
    done = subprocess.run(command, cwd=ROOT, capture_output=True, text=True, timeout=600)
    # the refused point is recorded, the sweep runs the others, then exits as the refusal does
    assert done.returncode == 2, done.stderr[-3000:]
    stopped = "a sweep point stopped (optimizer.lr=-1 debug=fast: refused: optimizer.lr=-1.0"
    assert stopped in done.stderr, done.stderr[-3000:]
    assert read_point(sweep / "0").status.startswith("refused: optimizer.lr=-1")
    for point, lr in (("1", "0.001"), ("2", "0.003")):
        log = (sweep / point / "forge.log").read_text()
        assert "FSDP over mesh {'dp_shard': 2}" in log  # two processes, not one
        assert f"optimizer.lr={lr}" in (sweep / point / ".hydra" / "overrides.yaml").read_text()
        row = read_point(sweep / point)
        assert row.status == "done"
        assert job_return([f"optimizer.lr={lr}"], sweep / point, 0).return_value == row.val_loss

    # run again: the finished points are kept without starting torchrun, the refused one is tried again
    metrics = {point: (sweep / point / "metrics.jsonl").read_bytes() for point in ("1", "2")}
    again = subprocess.run(command, cwd=ROOT, capture_output=True, text=True, timeout=600)
    assert again.returncode == 2, again.stderr[-3000:]
    out = again.stdout + again.stderr
    assert out.count("kept: ") == 2, out[-3000:]
    assert {point: (sweep / point / "metrics.jsonl").read_bytes() for point in ("1", "2")} == metrics


def test_a_failed_point_is_a_failed_job(tmp_path):
    ret = job_return(["optimizer.lr=1"], tmp_path, 1)
    assert ret.status.name == "FAILED"
    assert ret._return_value.line == "optimizer.lr=1: exited with 1"
    back = pickle.loads(pickle.dumps(ret._return_value))  # as submitit returns a SLURM job's failure
    assert (back.line, back.code, back.sweep_dir) == (ret._return_value.line, 1, str(tmp_path.parent))
