"""A sweep run again into its own folder (`hydra.sweep.dir=...`, the same command) goes on where it stopped: a point
whose run finished is kept (its objective read back from the record its run wrote when it ended, nothing trained),
a point that stopped early resumes from its latest checkpoint (`checkpoint.resume=auto`, as any run in a folder with
checkpoints), and a point that failed or was refused runs again. The basic sweeper asks the same points in the same
order; a seeded Optuna search asks them too, since the kept points give it back the values it was told the first
time (unless a trial that failed then succeeds now: the search then asks other points, and their folders refuse).

Every rank of a multi-rank point reads the same answer: the records change only when the point has ended."""

from pathlib import Path

import yaml

from forge.config.errors import ConfigError
from forge.launch.sweep_point import FINISHED_FILE


class SweepFolderTaken(ConfigError):
    """The point's folder holds a run of other overrides."""


OVERRIDES_FILE = Path(".hydra") / "overrides.yaml"
"""The point's command-line overrides, written by the trainer (forge.train.run_files) or with a failure record."""


def finished_objective(point_dir: Path, overrides: list[str]) -> tuple[bool, float | None]:
    """(True, its last validation loss) when `point_dir` holds a finished run of these overrides; (False, None) when
    the point must run: it never started, stopped early (a checkpoint is then resumed) or failed. A run of other
    overrides there is refused: its checkpoints would be resumed under this point's config."""
    recorded = point_dir / OVERRIDES_FILE
    if not recorded.is_file():
        return False, None
    earlier = [str(o) for o in read_yaml(recorded) or []]
    if earlier != list(overrides):
        raise SweepFolderTaken(
            f"{point_dir} holds a run of other overrides ({' '.join(earlier)}): the sweep asks other points than when "
            "it last ran in this folder; give it a new hydra.sweep.dir"
        )
    finished = point_dir / FINISHED_FILE
    if not finished.is_file():
        return False, None
    return True, (read_yaml(finished) or {}).get("val_loss")


def read_yaml(path: Path):
    try:
        return yaml.safe_load(path.read_text())
    except (OSError, UnicodeDecodeError, yaml.YAMLError) as err:
        raise SweepFolderTaken(f"cannot read {path} to resume the sweep: {type(err).__name__}: {err}") from None
