"""Shared pieces of the tests that really train: the tiny model shape, a trainer that dies mid-run, the loss curve."""

import json
from pathlib import Path

from forge.train.trainer import Trainer

TINY_MODEL = [
    "model.dim=64",
    "model.n_layers=2",
    "model.n_heads=4",
    "model.n_kv_heads=2",
    "model.ffn_dim=128",
]
"""2 layers, 64 wide, GQA (4 query, 2 KV heads): trains in seconds."""


class Crash(Exception):
    pass


class CrashAfterSteps:
    """Mixed into a trainer: dies (like a SIGKILL between steps) after `crash_after` optimizer steps of this
    process; subclass to change the count."""

    crash_after = 7

    def train_step(self, step: int):
        if self.crash_after == 0:
            raise Crash
        self.crash_after -= 1
        return super().train_step(step)


class CrashingTrainer(CrashAfterSteps, Trainer):
    """The text Trainer with CrashAfterSteps."""


def losses(run_dir: Path) -> dict[int, float]:
    """step -> loss from run_dir/metrics.jsonl (empty before it exists); a resumed run appends, and the last record
    of a step wins."""
    out: dict[int, float] = {}
    path = Path(run_dir) / "metrics.jsonl"
    if path.is_file():
        for line in path.read_text().splitlines():
            record = json.loads(line)
            if "loss" in record:
                out[record["step"]] = record["loss"]
    return out


def val_losses(run_dir: Path) -> dict[int, float]:
    """step -> val_loss from run_dir/metrics.jsonl."""
    path = Path(run_dir) / "metrics.jsonl"
    records = [json.loads(line) for line in path.read_text().splitlines()] if path.is_file() else []
    return {r["step"]: r["val_loss"] for r in records if "val_loss" in r}
