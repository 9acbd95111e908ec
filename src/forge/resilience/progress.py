"""Each rank's last started step, kept in the job's key-value store, so that a watchdog that fires can say which
rank is behind instead of only that its own step is late.

A stalled rank holds the others inside a collective of the step it never joined; every rank's watchdog then fires
at about the same time. The ranks that started a later step than another are waiting for it: the board names the
ones behind. One store write per step and rank (a small TCP message to the store).
"""

import logging
import threading

import torch.distributed as dist

log = logging.getLogger("forge")

_KEY = "forge/progress/{rank}"


class ProgressBoard:
    """A no-op in a single process (or without a default store)."""

    def __init__(self):
        self.store = None
        if dist.is_initialized() and dist.get_world_size() > 1:
            try:
                self.store = dist.distributed_c10d._get_default_store()
            except (RuntimeError, ValueError) as err:  # no store: the watchdog names only its own rank
                log.debug("no default store for the progress board: %s", err)
            self.rank, self.world = dist.get_rank(), dist.get_world_size()

    def started(self, step: int) -> None:
        if self.store is not None:
            self.store.set(_KEY.format(rank=self.rank), str(step))

    def last_started(self) -> dict[int, int | None]:
        """Each rank's last started step (None: not a step yet)."""
        steps: dict[int, int | None] = {}
        for rank in range(self.world):
            key = _KEY.format(rank=rank)
            steps[rank] = int(self.store.get(key)) if self.store.check([key]) else None
        return steps

    def report(self, timeout_s: float = 10.0) -> str:
        """One line on who is behind, read within `timeout_s` (the store may be gone with a dead rank 0)."""
        if self.store is None:
            return ""
        result: list[str] = []
        reader = threading.Thread(target=lambda: result.append(describe(self.last_started())), daemon=True)
        reader.start()
        reader.join(timeout_s)
        return result[0] if result else f"the ranks' progress could not be read within {timeout_s:g} s"


def describe(steps: dict[int, int | None]) -> str:
    """Which ranks have not started the newest step any rank started."""
    shown = ", ".join(f"{rank}: {'-' if step is None else step}" for rank, step in sorted(steps.items()))
    started = [step for step in steps.values() if step is not None]
    if not started:
        return f"last started step per rank: {shown}"
    newest = max(started)
    behind = [rank for rank, step in sorted(steps.items()) if step is None or step < newest]
    if not behind:
        return (
            f"last started step per rank: {shown}; every rank started step {newest}, so the stall is inside it (a "
            "rank whose main thread is not in a collective is holding the others)"
        )
    who = ("rank " if len(behind) == 1 else "ranks ") + ", ".join(map(str, behind))
    return f"last started step per rank: {shown}; {who} did not start step {newest} (stalled or dead before it)"
