"""Weights & Biases; offline by default (sync later with `wandb sync RUN_DIR/wandb/offline-run-*`)."""

from pathlib import Path
from typing import Any

import wandb

from forge.metrics.trackers.base import numeric


class WandbTracker:
    """One W&B run in run_dir/wandb; a given run_id resumes that run (same id, resume=allow)."""

    name = "wandb"

    def __init__(self, cfg: Any, run_dir: Path, run_id: str | None, config: dict | None):
        self.run = wandb.init(
            project=cfg.project,
            entity=cfg.wandb_entity,
            name=cfg.run_name,
            id=run_id,
            resume="allow" if run_id else None,
            mode=cfg.wandb_mode,
            dir=str(run_dir),
            config=config,
            settings=wandb.Settings(console="off", silent=True),
        )
        self.run_id: str | None = self.run.id

    def log(self, step: int, values: dict[str, float]) -> None:
        self.run.log(numeric(values), step=step)

    def close(self, exit_code: int = 0) -> None:
        self.run.finish(exit_code=exit_code)
