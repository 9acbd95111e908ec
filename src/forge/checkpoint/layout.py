"""Where checkpoints live and how a complete one is recognised.

A run's checkpoints are folders `step-00000100/` under its checkpoint directory. A folder counts only once it
holds the COMPLETE marker, written by rank 0 after every rank finished writing; the `latest` file names the newest
complete folder and is replaced atomically, so a reader never sees a half-written checkpoint.
"""

import os
import re
from pathlib import Path

from forge.checkpoint.errors import CheckpointError
from forge.files import temp_file

COMPLETE = "COMPLETE"
LATEST = "latest"
_STEP_DIR = re.compile(r"^step-(\d{8})$")
MAX_STEP = 10**8 - 1
"""The last step whose checkpoint folder name (eight digits) `_STEP_DIR` recognises."""


def step_dir(root: Path, step: int) -> Path:
    return root / f"step-{step:08d}"


def step_of(path: Path) -> int:
    match = _STEP_DIR.match(path.name)
    if not match:
        raise CheckpointError(f"{path} is not a checkpoint folder (expected a name like step-00000100)")
    return int(match.group(1))


def is_complete(path: Path) -> bool:
    return (path / COMPLETE).is_file() and (path / ".metadata").is_file()


def complete_checkpoints(root: Path) -> list[Path]:
    """Complete checkpoint folders under root, oldest first."""
    if not root.is_dir():
        return []
    found = [p for p in root.iterdir() if p.is_dir() and _STEP_DIR.match(p.name) and is_complete(p)]
    return sorted(found, key=step_of)


def write_atomic(path: Path, text: str) -> None:
    fd, tmp = temp_file(path.parent, prefix=f".{path.name}.")
    with os.fdopen(fd, "w") as f:
        f.write(text)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)


def mark_complete(root: Path, path: Path) -> None:
    """Seal a fully written checkpoint and point `latest` at it."""
    write_atomic(path / COMPLETE, "")
    write_atomic(root / LATEST, path.name + "\n")


def latest_checkpoint(root: Path) -> Path | None:
    """The newest complete checkpoint: the one `latest` names, or the newest sealed folder if it is missing."""
    pointer = root / LATEST
    if pointer.is_file():
        candidate = root / pointer.read_text().strip()
        if is_complete(candidate):
            return candidate
    complete = complete_checkpoints(root)
    return complete[-1] if complete else None


def resolve_checkpoint(path: str | Path) -> Path:
    """A checkpoint folder from a checkpoint folder, a checkpoint root, or a run directory."""
    path = Path(path).expanduser()
    if not path.exists():
        raise CheckpointError(f"checkpoint path {path} does not exist")
    if _STEP_DIR.match(path.name):
        if not is_complete(path):
            raise CheckpointError(f"checkpoint {path} is incomplete (no {COMPLETE} marker or .metadata)")
        return path
    for root in (path, path / "checkpoints"):
        found = latest_checkpoint(root)
        if found is not None:
            return found
    raise CheckpointError(f"no complete checkpoint found in {path}")
