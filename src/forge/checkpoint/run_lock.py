"""One job per run directory: an exclusive lock, so a second job (a requeued SLURM job while the old one still
drains, the same command typed twice) never trains into the same checkpoints.

Global rank 0 holds an flock on `forge.lock` in the run directory for the life of the run; the kernel drops it when
the process ends, however it ends, so a lock is never stale. The file names the holder (host, pid, start time).
The other ranks learn rank 0's outcome from one broadcast per poll, so nobody sits in a long collective while
rank 0 waits.
"""

import datetime
import fcntl
import logging
import os
import socket
import time
from pathlib import Path

import torch
import torch.distributed as dist

from forge.checkpoint.errors import CheckpointError

log = logging.getLogger("forge")

LOCK_NAME = "forge.lock"
_WAITING, _HELD, _GAVE_UP = 0, 1, 2


_HELD_HERE: dict[Path, "RunDirLock"] = {}  # locks this process holds: a later run in the same process takes them over


class RunDirLock:
    """An flock on one file; `try_acquire` never blocks."""

    def __init__(self, path: Path):
        self.path = path.resolve()  # one key per folder in _HELD_HERE however it was spelled
        self._fd: int | None = None

    def try_acquire(self) -> bool:
        earlier = _HELD_HERE.pop(self.path, None)
        if earlier is not None:  # an earlier run of this process that was never closed
            self._fd, earlier._fd = earlier._fd, None
            _HELD_HERE[self.path] = self
            return True
        fd = os.open(self.path, os.O_RDWR | os.O_CREAT, 0o666)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            os.close(fd)
            return False
        stamp = datetime.datetime.now().astimezone().isoformat(timespec="seconds")
        os.ftruncate(fd, 0)
        os.pwrite(fd, f"host={socket.gethostname()} pid={os.getpid()} since={stamp}\n".encode(), 0)
        self._fd = fd
        _HELD_HERE[self.path] = self
        return True

    def release(self) -> None:
        if self._fd is not None:
            os.close(self._fd)  # closing the only descriptor drops the flock
            self._fd = None
            _HELD_HERE.pop(self.path, None)


def holder(path: Path) -> str:
    """Who holds the lock, as its file says."""
    try:
        text = path.read_text().strip()
    except OSError:
        text = ""
    return text.replace("=", " ") if text else "another process"


def hold_run_dir(run_dir: Path, mode: str, timeout_s: float, poll_s: float = 1.0) -> RunDirLock | None:
    """Lock the run directory for this job (collective: every rank calls it). mode=wait retries for up to
    timeout_s, refuse gives up at once; either way a held lock ends in a CheckpointError naming the holder."""
    if mode == "off":
        return None
    lead = not dist.is_initialized() or dist.get_rank() == 0
    path = Path(run_dir) / LOCK_NAME
    lock = None
    if lead:
        try:
            path.parent.mkdir(parents=True, exist_ok=True)
            lock = RunDirLock(path)
        except OSError as err:
            raise CheckpointError(f"cannot use the run directory {run_dir}: {err.strerror or err}") from err
    deadline = time.monotonic() + (timeout_s if mode == "wait" else 0.0)
    told = False
    while True:
        if lock is not None:
            state = _HELD if lock.try_acquire() else (_GAVE_UP if time.monotonic() >= deadline else _WAITING)
        state = _agree(state if lead else _WAITING)
        if state == _HELD:
            return lock
        if state == _GAVE_UP:
            hint = (
                "checkpoint.run_lock=wait to wait for it"
                if mode == "refuse"
                else f"a longer checkpoint.run_lock_timeout_s (waited {timeout_s:g}s)"
            )
            raise CheckpointError(
                f"the run directory {run_dir} is in use by {holder(path)} ({path}): let that run end, use another "
                f"hydra.run.dir, or {hint}"
            )
        if lead and not told:
            log.warning(
                "the run directory %s is in use by %s: waiting up to %gs for it", run_dir, holder(path), timeout_s
            )
            told = True
        time.sleep(poll_s)


def _agree(state: int) -> int:
    """Rank 0's state on every rank."""
    if not dist.is_initialized() or dist.get_world_size() == 1:
        return state
    device = torch.device("cuda", torch.cuda.current_device()) if dist.get_backend() == "nccl" else None
    value = torch.tensor(state, device=device)
    dist.broadcast(value, src=0)
    return int(value.item())
