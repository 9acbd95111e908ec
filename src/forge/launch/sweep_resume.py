"""A sweep run again into its own folder (`hydra.sweep.dir=...`, the same command) goes on where it stopped: a point
whose run finished is kept (its objective read back from its metrics, nothing trained), a point that stopped early
resumes from its latest checkpoint (`checkpoint.resume=auto`, as any run in a folder with checkpoints), and a point
that failed or was refused runs again. The basic sweeper asks the same points in the same order; a seeded Optuna
search asks them too, since the kept points give it back the values it was told the first time."""

from pathlib import Path

import yaml

from forge.config.errors import ConfigError


class SweepFolderTaken(ConfigError):
    """The point's folder holds a run of other overrides."""


OVERRIDES_FILE = Path(".hydra") / "overrides.yaml"
"""The point's command-line overrides, written by the trainer (forge.train.run_files) or with a failure record."""


def finished_objective(point_dir: Path, overrides: list[str]) -> tuple[bool, float | None]:
    """(True, its last validation loss) when `point_dir` holds a finished run of these overrides; (False, None) when
    the point must run: it never started, stopped early (a checkpoint is then resumed) or failed (its record stays
    until this attempt finishes: every rank of the point reads the same answer). A run of other overrides there is
    refused: its checkpoints would be resumed under this point's config."""
    recorded = point_dir / OVERRIDES_FILE
    if not recorded.is_file():
        return False, None
    earlier = [str(o) for o in yaml.safe_load(recorded.read_text()) or []]
    if earlier != list(overrides):
        raise SweepFolderTaken(
            f"{point_dir} holds a run of other overrides ({' '.join(earlier)}): a sweep run again must give its "
            "points in the same order; give this one a new hydra.sweep.dir"
        )
    from forge.launch.sweep_report import read_point  # here: it imports the plotting code

    point = read_point(point_dir)
    return (True, point.val_loss) if point.status == "done" else (False, None)
