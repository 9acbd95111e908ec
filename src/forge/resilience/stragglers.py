"""Name the ranks that are slower than their peers.

A slow rank does not show in its peers' step times, nor in its own: every collective waits for it, so every rank's
step lasts as long as the slowest one's. What differs is how much of the step a rank spent working. The clock
therefore measures each rank's busy time: its main thread's time on a CPU plus its time waiting for one (a CPU
shared with other work counts as busy, a wait in a collective or for data does not), from Linux's per-thread
scheduler statistics, from the step's start to its check (data, forward, backward, clipping; the optimizer step
comes after the check and is not counted). On a GPU this is the host's side of the step (launching kernels,
loading data): a rank whose device alone is slow is not seen, and a host sync (an MoE layer's split sizes, an
`.item()`) spins by default, so its wait counts as busy.

Each log step, every rank's mean busy time per step since the last log step rides in the step's flags all-reduce
(one int64 per rank; no collective of its own). Ranks are compared with the median of the ranks that do the same
work, the ranks of one pipeline stage (stages differ by design): each with the median of the others.
"""

import bisect
import time
from pathlib import Path

import torch

_SCHEDSTAT = Path("/proc/thread-self/schedstat")


def busy_ns() -> int:
    """The calling thread's nanoseconds on a CPU plus waiting for one; its CPU time alone where the kernel keeps no
    scheduler statistics."""
    try:
        on_cpu, waiting, _ = _SCHEDSTAT.read_text().split()
        return int(on_cpu) + int(waiting)
    except (OSError, ValueError):
        return time.thread_time_ns()


def spin(seconds: float) -> None:
    """Work on the CPU for `seconds` (the fault-injection hook of a slow rank: busy, unlike a sleep)."""
    end = time.perf_counter() + seconds
    while time.perf_counter() < end:
        pass


class StragglerClock:
    """This rank's busy time per step, shared on log steps, and the report of who is slow."""

    def __init__(self, factor: float, rank: int, groups: list[list[int]]):
        """`factor`: a rank is slow when its busy time exceeds `factor` times its group's median (0: off).
        `groups`: the ranks that do the same work, compared with each other (every rank in exactly one)."""
        self.factor, self.rank = factor, rank
        self.groups = [group for group in groups if len(group) > 1]
        self.world = sum(len(group) for group in groups)
        self.enabled = factor > 0 and bool(self.groups)
        self.started: int | None = None
        self.busy, self.steps = 0, 0  # since the last shared log step
        self.report: dict = {}

    def step_started(self) -> None:
        if self.enabled:
            self.started = busy_ns()

    def step_done(self) -> None:
        """The step's work is launched (its flags are next): count its busy time."""
        if self.enabled and self.started is not None:
            self.busy += busy_ns() - self.started
            self.steps += 1
            self.started = None

    def share(self, device: torch.device) -> torch.Tensor | None:
        """For a log step's flags: one int64 per rank, this rank's mean busy microseconds per step at its index and
        zeros elsewhere (the flags' SUM gives every rank all of them). None when off."""
        if not self.enabled:
            return None
        mine = torch.zeros(self.world, dtype=torch.int64)
        mine[self.rank] = self.busy // max(self.steps, 1) // 1000
        self.busy, self.steps = 0, 0
        return mine.to(device, non_blocking=True)

    def observe(self, busy_us: list[int]) -> None:
        """Every rank's mean busy time, read from a log step's flags: the report `metrics` returns. Each rank is
        compared with the median of the others of its group (with two ranks, the other one)."""
        slow, worst = [], 0.0
        for group in self.groups:
            times = sorted(busy_us[rank] for rank in group)
            for rank in group:
                others = median_without(times, busy_us[rank])
                if others > 0:
                    worst = max(worst, busy_us[rank] / others)
                    if busy_us[rank] > self.factor * others:
                        slow.append(rank)
        self.report = {
            "busy_time_max_over_median": worst,
            "busy_time_s": busy_us[self.rank] / 1e6,
            "straggler_ranks": sorted(slow),
        }

    def metrics(self) -> dict:
        """The last log step's report (empty when off or before the first)."""
        return dict(self.report)


def median_without(times: list[int], value: int) -> float:
    """The median of sorted `times` with one occurrence of `value` left out, in O(log n)."""
    gone = bisect.bisect_left(times, value)
    n = len(times) - 1

    def kept(k: int) -> int:  # the k-th smallest of the others
        return times[k if k < gone else k + 1]

    return kept(n // 2) if n % 2 else (kept(n // 2 - 1) + kept(n // 2)) / 2
