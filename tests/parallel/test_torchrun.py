"""`forge-train` under torchrun, end to end: two gloo ranks with FSDP, one run directory, rank 0 writes metrics."""

import json
import subprocess
import sys

import pytest

from tests.parallel.scenarios import TINY

pytestmark = pytest.mark.dist


def test_torchrun_fsdp_end_to_end(tmp_path):
    cmd = [
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--standalone",
        "--nproc_per_node=2",
        "-m",
        "forge.train",
        "parallel=fsdp",
        *TINY,
        "train.micro_batch_size=4",
        "metrics.console=line",
        f"hydra.run.dir={tmp_path}",
    ]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=240)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    records = [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in records if "loss" in r] == [1, 2, 3, 4]  # once each: only rank 0 writes
    assert [r["step"] for r in records if "val_loss" in r] == [0, 4]
    log_text = (tmp_path / "forge.log").read_text()
    assert log_text.count("FSDP over mesh {'dp_shard': 2}") == 1
    assert log_text.count("done: 4 steps") == 1
