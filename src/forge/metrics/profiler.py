"""A torch.profiler window over training steps, and an optional CUDA memory snapshot of the same window.

Writes into run_dir/profile/: trace_rank{R}.json (Chrome trace; open in chrome://tracing or Perfetto),
summary_rank{R}.txt (the top operators by self time) and, on CUDA, memory_snapshot_rank{R}.pickle (open at
pytorch.org/memory_viz).
"""

import logging
from pathlib import Path

import torch
from torch.profiler import ProfilerActivity, profile

log = logging.getLogger("forge")


class StepProfiler:
    """Profiles optimizer steps first..last (inclusive, numbered as in the log); first=0 disables it."""

    def __init__(
        self,
        run_dir: Path,
        first: int,
        last: int,
        total_steps: int,
        device: torch.device,
        memory_snapshot: bool = False,
        rank: int = 0,
    ):
        self.dir = Path(run_dir) / "profile"
        self.first, self.last = first, min(last, total_steps)
        self.device, self.rank = device, rank
        self.memory_snapshot = memory_snapshot
        self.active: profile | None = None
        self.enabled = first > 0 and self.last >= first
        if first > 0 and not self.enabled:
            log.warning("profiler off: metrics.profile_end_step (%d) is before profile_start_step (%d)", last, first)

    def step_started(self, step: int) -> None:
        """Call before running optimizer step `step`."""
        if not self.enabled or step != self.first:
            return
        activities = [ProfilerActivity.CPU]
        if self.device.type == "cuda":
            activities.append(ProfilerActivity.CUDA)
        self.active = profile(activities=activities, record_shapes=True, profile_memory=True, with_stack=False)
        self.active.start()
        if self.memory_snapshot:
            if self.device.type == "cuda":
                torch.cuda.memory._record_memory_history(max_entries=200_000)
            else:
                log.info("CUDA memory snapshot skipped: the device is %s", self.device)

    def step_finished(self, step: int) -> None:
        """Call after optimizer step `step` completed; ends the window at its last step."""
        if self.active is None:
            return
        self.active.step()
        if step < self.last:
            return
        self.active.stop()
        self.dir.mkdir(parents=True, exist_ok=True)
        trace = self.dir / f"trace_rank{self.rank}.json"
        self.active.export_chrome_trace(str(trace))
        sort_by = "self_cuda_time_total" if self.device.type == "cuda" else "self_cpu_time_total"
        table = self.active.key_averages().table(sort_by=sort_by, row_limit=40)
        (self.dir / f"summary_rank{self.rank}.txt").write_text(table + "\n")
        if self.memory_snapshot and self.device.type == "cuda":
            torch.cuda.memory._dump_snapshot(str(self.dir / f"memory_snapshot_rank{self.rank}.pickle"))
            torch.cuda.memory._record_memory_history(enabled=None)
        log.info("profiled steps %d-%d: %s", self.first, self.last, self.dir)
        self.active, self.enabled = None, False
