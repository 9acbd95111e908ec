"""The run directory's own faults (a read-only folder, a file where a folder should be, a full disk) in one line
naming the path, before Hydra opens its log file there (whose failure reads "Unable to configure handler 'file'")."""

import os
import sys
import tempfile
from pathlib import Path
from typing import Any

from hydra.experimental.callback import Callback
from omegaconf import DictConfig, OmegaConf

EXIT_RUN_DIR_ERROR = 2


def run_dir_fault(folder: Path) -> str | None:
    """Why a run cannot write into `folder` (made if missing), or None when it can: a small file is written and
    removed, which also finds a full disk and a read-only mount that permission bits do not show."""
    if folder.exists() and not folder.is_dir():
        return f"{folder} is a file, not a folder"
    try:
        folder.mkdir(parents=True, exist_ok=True)
        handle, probe = tempfile.mkstemp(prefix=".forge-write-check-", dir=folder)  # unique across hosts and ranks
        try:
            os.write(handle, b"forge")
        finally:
            os.close(handle)
            Path(probe).unlink(missing_ok=True)
    except OSError as err:
        where = err.filename or folder
        return f"{where}: {err.strerror or type(err).__name__}"
    return None


def check_run_dir(config: DictConfig, key: str) -> None:
    """Exit 2 with one line when the folder `key` (hydra.run.dir or hydra.sweep.dir) cannot be written. An empty
    value is left to forge-train's own check (forge.train.main.check_output_dir)."""
    folder = str(OmegaConf.select(config, key) or "").strip()
    if not folder:
        return
    fault = run_dir_fault(Path(folder))
    if fault:
        print(f"forge-train: the run directory cannot be written ({key}={folder}): {fault}", file=sys.stderr)
        sys.exit(EXIT_RUN_DIR_ERROR)


class RunDirCheck(Callback):
    """Hydra callback: the run (or sweep) directory is made and written to once before a job starts."""

    def on_run_start(self, config: DictConfig, **kwargs: Any) -> None:
        check_run_dir(config, "hydra.run.dir")

    def on_multirun_start(self, config: DictConfig, **kwargs: Any) -> None:
        check_run_dir(config, "hydra.sweep.dir")
