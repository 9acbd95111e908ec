"""conf/debug and conf/experiment: each debug preset does what it says on a real run; each shipped experiment
composes, validates and plans at its own world size."""

import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from forge.config import compose
from forge.config.paths import conf_dir
from forge.train.trainer import Trainer


def forge_train(*overrides: str, run_dir: Path) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "forge.train", *overrides, f"hydra.run.dir={run_dir}"],
        capture_output=True, text=True, timeout=600,
    )  # fmt: skip


def last_loss(run_dir: Path) -> float:
    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    return [row["loss"] for row in rows if "loss" in row][-1]


def test_overfit_drives_one_batchs_loss_towards_zero(tmp_path):
    # the preset at any batch; a small one of short sequences is quick
    batch = ("train.global_batch_size=4", "train.micro_batch_size=4", "train.seq_len=64")
    done = forge_train("debug=overfit", "train.log_every=20", *batch, run_dir=tmp_path / "one")
    assert done.returncode == 0, done.stderr[-2000:]
    assert last_loss(tmp_path / "one") < 0.5
    # the control: on the data as it comes, a third of those steps (as far as the threshold needs) stays far above it
    control = forge_train("debug=overfit", "train.overfit_batches=0", "train.steps=20", "train.log_every=20", *batch,
                          run_dir=tmp_path / "all")  # fmt: skip
    assert control.returncode == 0, control.stderr[-2000:]
    assert last_loss(tmp_path / "all") > 3.0


def test_profile_writes_a_trace(tmp_path):
    done = forge_train("debug=profile", run_dir=tmp_path)
    assert done.returncode == 0, done.stderr[-2000:]
    assert any((tmp_path / "profile").rglob("*.json*")), sorted(p.name for p in (tmp_path / "profile").rglob("*"))


@pytest.mark.parametrize("preset", ["anomaly", "determinism"])
def test_the_modes_are_on_during_the_steps_and_restored_after(preset, tmp_path, monkeypatch):
    cfg = compose([f"debug={preset}", "train.steps=2", "scheduler.warmup_steps=1", "parallel=single"])
    trainer = Trainer(cfg, tmp_path)
    seen = []
    original = trainer.train_step

    def recording(step):
        anomaly = torch.is_anomaly_enabled() and torch.is_anomaly_check_nan_enabled()
        seen.append((anomaly, torch.are_deterministic_algorithms_enabled()))
        return original(step)

    monkeypatch.setattr(trainer, "train_step", recording)
    trainer.fit()
    expected = (True, False) if preset == "anomaly" else (False, True)
    assert seen == [expected, expected]
    assert not torch.is_anomaly_enabled() and not torch.are_deterministic_algorithms_enabled()


EXPERIMENTS = sorted(p.stem for p in (conf_dir() / "experiment").glob("*.yaml"))


@pytest.mark.parametrize("experiment", EXPERIMENTS)
def test_each_experiment_plans(experiment, tmp_path):
    done = forge_train(f"experiment={experiment}", "--plan", run_dir=tmp_path)
    assert done.returncode == 0, done.stderr[-2000:]
    world = compose([f"experiment={experiment}"]).parallel.world_size or 1
    assert f"plan for {world} ranks" in done.stdout
