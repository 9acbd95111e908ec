"""Weights & Biases; offline by default (sync later with `wandb sync RUN_DIR/wandb/offline-run-*`)."""

from pathlib import Path

import wandb

from forge.metrics.trackers.base import numeric


class WandbTracker:
    """One W&B run in run_dir/wandb; a given run_id resumes that run (same id, resume=allow)."""

    name = "wandb"

    def __init__(
        self,
        mode: str,
        entity: str | None,
        *,
        run_dir: Path,
        run_id: str | None,
        config: dict | None,
        project: str,
        run_name: str | None,
    ):
        self.run = wandb.init(
            project=project,
            entity=entity,
            name=run_name,
            id=run_id,
            resume="allow" if run_id else None,
            mode=str(mode),
            dir=str(run_dir),
            config=config,
            settings=wandb.Settings(console="off", silent=True),
        )
        self.run_id: str | None = self.run.id

    def log(self, step: int, values: dict[str, float]) -> None:
        self.run.log(numeric(values), step=step)

    def close(self, exit_code: int = 0) -> None:
        self.run.finish(exit_code=exit_code)
