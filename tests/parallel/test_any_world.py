"""One forge-train command line, unchanged, on one process, on 2 and 4 torchrun ranks and as a 2-task SLURM job.

Nothing in COMMAND names a layout, a micro-batch or a world size: the default parallel preset (FSDP over every rank)
and the automatic micro-batch (global batch / dp ranks) fit the world each launch gives. Every layout takes the same
global batch of the same samples, so the fp32 curves must agree up to the order of the gradient reductions.
"""

import subprocess
import sys
from pathlib import Path

import pytest

from tests.conftest import ROOT, forge_cmd
from tests.launch.conftest import slurm, sweep  # noqa: F401 - slurm: the local cluster fixture
from tests.tiny import losses, val_losses

pytestmark = [pytest.mark.slow, pytest.mark.dist]

COMMAND = ["train.steps=6", "train.log_every=1", "train.dtype=fp32", "train.eval_every=3", "train.eval_batches=2"]
"""A short run of the default model (llama_tiny) on the default data; nothing about the layout."""

REL = 1e-4
"""fp32 sums of 8 per-sample gradients in another order (reduce-scatter vs one process): ~1e-6 relative."""


def torchrun(nproc: int, run_dir: Path) -> str:
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={nproc}",
           "-m", "forge.train", *COMMAND, f"hydra.run.dir={run_dir}"]  # fmt: skip
    proc = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=400)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    return (run_dir / "forge.log").read_text()


@pytest.fixture(scope="module")
def one_process(tmp_path_factory) -> Path:
    run_dir = tmp_path_factory.mktemp("one")
    proc = subprocess.run(
        forge_cmd(*COMMAND, f"hydra.run.dir={run_dir}"), cwd=ROOT, capture_output=True, text=True, timeout=300
    )
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    log = (run_dir / "forge.log").read_text()
    assert "FSDP" not in log and "grad accum 1" in log  # one process runs plain
    assert "warmup cut to 6 steps" in log  # the preset's 20 warmup steps, fitted to this short run
    return run_dir


def assert_same_curve(run_dir: Path, reference: Path) -> None:
    for read in (losses, val_losses):
        got, want = read(run_dir), read(reference)
        assert sorted(got) == sorted(want) and want, (got, want)
        for step, value in want.items():
            assert got[step] == pytest.approx(value, rel=REL), (read.__name__, step, got[step], value)


@pytest.mark.parametrize("nproc", [2, 4])
def test_torchrun_ranks_follow_the_one_process_curve(nproc, one_process, tmp_path):
    log = torchrun(nproc, tmp_path)
    assert f"FSDP over mesh {{'dp_shard': {nproc}}}" in log
    assert "grad accum 1" in log  # micro-batch 8 / nproc on each rank: the global batch of 8 in one step
    assert log.count("warmup cut") == 1  # said once, by rank 0
    records = (tmp_path / "metrics.jsonl").read_text().splitlines()
    assert sum('"loss"' in r for r in records) == 6  # each step once: only rank 0 writes metrics
    assert_same_curve(tmp_path, one_process)


def test_two_task_slurm_job_follows_the_one_process_curve(slurm, one_process, tmp_path):  # noqa: F811
    code, out = sweep(tmp_path, "hydra/launcher=local_slurm", "hydra.launcher.tasks_per_node=2", *COMMAND)
    assert code == 0, out
    run_dir = tmp_path / "0"
    assert "FSDP over mesh {'dp_shard': 2}" in (run_dir / "forge.log").read_text()
    assert len(list((tmp_path / ".submitit").glob("*/*_log.out"))) == 2  # one SLURM task per rank
    assert_same_curve(run_dir, one_process)
