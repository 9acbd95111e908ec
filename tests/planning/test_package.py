"""The planning package (FLOPs, the memory model, `--plan`, the layout search) reads the model through its family's
spec and never imports the trainer."""

import subprocess
import sys

from tests.conftest import ROOT


def test_plan_and_search_run_without_the_trainer(tmp_path):
    for flags in (["--plan"], ["--plan", "--search"]):
        cmd = [sys.executable, "-X", "importtime", "-m", "forge.train", *flags, "parallel.world_size=8"]  # fresh
        done = subprocess.run([*cmd, f"hydra.run.dir={tmp_path}"], cwd=ROOT, capture_output=True, text=True,
                              timeout=300)  # fmt: skip
        assert done.returncode == 0, done.stderr[-2000:]
        names = {line.rsplit("|", 1)[1].strip() for line in done.stderr.splitlines() if line.startswith("import time:")}
        assert "forge.planning.memory" in names and "forge.models.llama.cost" in names  # the control
        assert not {n for n in names if n.startswith(("forge.train.trainer", "forge.train.steps"))}, flags
