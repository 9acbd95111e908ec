"""The tracker interface and the factory that builds the trackers named in metrics.trackers, each from its
`_target_` in metrics.tracker_configs (a tracker's package is imported only by a run that uses it)."""

from pathlib import Path
from typing import Any, Protocol

from hydra.utils import instantiate


class Tracker(Protocol):
    """One experiment tracker, built from its config in metrics.tracker_configs (its `_target_` and options) and
    the keywords `run_dir`, `run_id` (the run to continue, None for a new run), `config` (the run's config),
    `project` and `run_name` (metrics.project and metrics.run_name); `run_id` is what a checkpoint stores to
    continue the same run on resume. `name` is its key in metrics.tracker_configs."""

    name: str
    run_id: str | None

    def log(self, step: int, values: dict[str, float]) -> None: ...

    def close(self, exit_code: int = 0) -> None:
        """End the run; a non-zero exit_code marks it failed (the watchdog's 76, a lost peer's 77, a crash's 1)."""
        ...


def build_trackers(cfg: Any, run_dir: Path, run_ids: dict[str, str], config: dict | None = None) -> list[Tracker]:
    """The trackers of `cfg.trackers` (a MetricsConfig), resuming the runs in `run_ids` by tracker name."""
    unknown = [name for name in cfg.trackers if name not in cfg.tracker_configs]
    if unknown:
        raise ValueError(f"metrics.trackers: unknown {unknown}; choose from {list(cfg.tracker_configs)}")
    trackers = []
    for name in cfg.trackers:
        make = instantiate(cfg.tracker_configs[name], _partial_=True, _convert_="all")
        run = {"run_dir": run_dir, "run_id": run_ids.get(name), "config": config}
        tracker = make(**run, project=cfg.project, run_name=cfg.run_name)
        tracker.name = name
        trackers.append(tracker)
    return trackers


def numeric(values: dict) -> dict[str, float]:
    """The int/float entries of a record (trackers take scalars only)."""
    return {k: float(v) for k, v in values.items() if isinstance(v, int | float) and not isinstance(v, bool)}
