"""End a job whose step takes far longer than usual instead of letting it hang forever."""

import logging
import os
import statistics
import sys
import threading
import time
import traceback
from collections.abc import Callable

from forge.resilience.hard_exit import hard_exit

log = logging.getLogger("forge")

EXIT_HUNG = 76


class StepWatchdog:
    """A daemon thread: if the current step runs longer than max(factor x median step, min_s), log and exit."""

    def __init__(
        self,
        factor: float,
        min_s: float,
        poll_s: float = 1.0,
        peers: Callable[[], str] | None = None,
        on_fire: Callable[[], None] | None = None,
    ):
        self.factor = factor
        self.peers = peers  # a line on the other ranks' progress, when there are others
        self.on_fire = on_fire  # what the rank saves after its error line, before it ends (its flight recorder)
        self.min_s = min_s
        self.poll_s = poll_s
        self.durations: list[float] = []
        self._started: float | None = None
        self._step: int | None = None
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._watch, daemon=True, name="forge-watchdog")
        self._thread.start()

    def step_started(self, step: int | None = None) -> None:
        self._step = step
        self._started = time.monotonic()

    def step_finished(self) -> None:
        if self._started is not None:
            self.durations.append(time.monotonic() - self._started)
            self.durations = self.durations[-100:]
        self._started = None

    def limit(self) -> float:
        median = statistics.median(self.durations) if self.durations else 0.0
        return max(self.factor * median, self.min_s)

    def _watch(self) -> None:
        while not self._stop.wait(self.poll_s):
            started = self._started
            if started is None or len(self.durations) < 3:
                continue
            elapsed = time.monotonic() - started
            if elapsed > self.limit():
                peers = self.peers() if self.peers is not None else ""
                log.error(
                    "watchdog: %sstep %s has run %.1f s, over %.1f s (%.0fx the median step); a rank is stalled or "
                    "a peer is dead — ending the job (exit code %d).%s This rank's main thread is at:\n%s",
                    _rank_prefix(),
                    "?" if self._step is None else self._step,
                    elapsed,
                    self.limit(),
                    self.factor,
                    EXIT_HUNG,
                    f" {peers}." if peers else "",
                    main_thread_stack(),
                )
                if self.on_fire is not None:
                    self.on_fire()
                hard_exit(EXIT_HUNG)

    def stop(self) -> None:
        self._stop.set()


def _rank_prefix() -> str:
    rank = os.environ.get("RANK")
    return f"rank {rank}, " if rank is not None else ""


def main_thread_stack(frames: int = 4) -> str:
    """The innermost frames of the main thread: in a collective on a waiting rank, elsewhere on a stalled one."""
    frame = sys._current_frames().get(threading.main_thread().ident)
    if frame is None:
        return "  (unknown)"
    return "".join(traceback.format_stack(frame)[-frames:]).rstrip()
