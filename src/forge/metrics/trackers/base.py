"""The tracker interface and the factory that builds the trackers named in metrics.trackers."""

from pathlib import Path
from typing import Any, Protocol

from hydra.utils import get_class

TRACKER_CLASSES = {
    "tensorboard": "forge.metrics.trackers.tensorboard_tracker.TensorBoardTracker",
    "wandb": "forge.metrics.trackers.wandb_tracker.WandbTracker",
    "mlflow": "forge.metrics.trackers.mlflow_tracker.MlflowTracker",
}
"""The class of each name in metrics.trackers, by path: a tracker's package is imported only by a run that uses it."""

TRACKER_NAMES = tuple(TRACKER_CLASSES)


class Tracker(Protocol):
    """One experiment tracker, built as `cls(cfg, run_dir, run_id, config)` from a MetricsConfig, the run folder, the
    run id to continue (None for a new run) and the run's config; `run_id` is what a checkpoint stores to continue
    the same run on resume."""

    name: str
    run_id: str | None

    def log(self, step: int, values: dict[str, float]) -> None: ...

    def close(self, exit_code: int = 0) -> None:
        """End the run; a non-zero exit_code marks it failed (the watchdog's 76, a lost peer's 77, a crash's 1)."""
        ...


def build_trackers(cfg: Any, run_dir: Path, run_ids: dict[str, str], config: dict | None = None) -> list[Tracker]:
    """The trackers of `cfg.trackers` (a MetricsConfig), resuming the runs in `run_ids` by tracker name."""
    unknown = [name for name in cfg.trackers if name not in TRACKER_NAMES]
    if unknown:
        raise ValueError(f"metrics.trackers: unknown {unknown}; choose from {list(TRACKER_NAMES)}")
    return [get_class(TRACKER_CLASSES[name])(cfg, run_dir, run_ids.get(name), config) for name in cfg.trackers]


def numeric(values: dict) -> dict[str, float]:
    """The int/float entries of a record (trackers take scalars only)."""
    return {k: float(v) for k, v in values.items() if isinstance(v, int | float) and not isinstance(v, bool)}
