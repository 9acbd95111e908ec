"""metrics.jsonl (always), the console line and the optional trackers."""

import json
import logging
import math
import threading
import time
from collections.abc import Sequence
from pathlib import Path

from forge.config.schema import ConsoleMode, MetricsConfig
from forge.metrics.trackers import Tracker, build_trackers
from forge.resilience.progress import rank_ranges

log = logging.getLogger("forge")


def format_duration(seconds: float) -> str:
    seconds = int(max(0, seconds))
    hours, rest = divmod(seconds, 3600)
    minutes, secs = divmod(rest, 60)
    return f"{hours}:{minutes:02d}:{secs:02d}" if hours else f"{minutes:02d}:{secs:02d}"


def speed_text(metrics: dict) -> str:
    """' | step 0.123s (data 1%) | MFU 12.3% | mem 1.2/3.4 GiB | slow ranks 3 (busy 2.0x the median)' for the
    fields present."""
    parts = []
    if "step_time" in metrics:
        data = metrics.get("data_wait")
        share = f" (data {100 * data / metrics['step_time']:.0f}%)" if data is not None and metrics["step_time"] else ""
        parts.append(f"step {metrics['step_time']:.3f}s{share}")
    if "mfu" in metrics:
        parts.append(f"MFU {100 * metrics['mfu']:.1f}%")
    if "mem_peak_gib" in metrics:
        parts.append(f"mem {metrics['mem_allocated_gib']:.2f}/{metrics['mem_peak_gib']:.2f} GiB")
    elif "mem_rss_gib" in metrics:
        parts.append(f"rss {metrics['mem_rss_gib']:.2f} GiB")
    if metrics.get("straggler_ranks"):
        ranks = rank_ranges(metrics["straggler_ranks"])
        parts.append(f"slow ranks {ranks} (busy {metrics['busy_time_max_over_median']:.1f}x the median)")
    return "".join(f" | {p}" for p in parts)


class MetricsLogger:
    """Appends one JSON object per record to run_dir/metrics.jsonl, prints a console line, feeds the trackers."""

    def __init__(
        self,
        run_dir: Path,
        total_steps: int,
        console: str = "line",
        smoothing: float = 0.9,
        trackers: Sequence[Tracker] = (),
    ):
        if console not in tuple(ConsoleMode):
            raise ValueError(f"metrics.console={console!r} is not one of {', '.join(ConsoleMode)}")
        self.path = Path(run_dir) / "metrics.jsonl"
        self.path.parent.mkdir(parents=True, exist_ok=True)
        self._file = self.path.open("a", encoding="utf-8")
        self._lock = threading.Lock()
        self._closed = False
        self.total_steps = total_steps
        self.console = console
        self.smoothing = smoothing
        self.smoothed: float | None = None
        self.trackers = list(trackers)
        self.start = time.perf_counter()

    @classmethod
    def from_config(
        cls,
        cfg: MetricsConfig,
        run_dir: Path,
        total_steps: int,
        tracker_ids: dict[str, str] | None = None,
        config: dict | None = None,
    ) -> "MetricsLogger":
        """From a MetricsConfig; `tracker_ids` (from a checkpoint) continue the same tracker runs."""
        trackers = build_trackers(cfg, Path(run_dir), dict(tracker_ids or {}), config)
        return cls(run_dir, total_steps, cfg.console, cfg.smoothing, trackers)

    def tracker_ids(self) -> dict[str, str]:
        """Run ids by tracker name (what a checkpoint stores to resume the same runs)."""
        return {t.name: t.run_id for t in self.trackers if t.run_id is not None}

    def _write(self, step: int, record: dict) -> None:
        with self._lock:
            if self._closed:
                return
            self._file.write(json.dumps(record) + "\n")
            self._file.flush()
            values = {k: v for k, v in record.items() if k != "step"}
            for tracker in self.trackers:
                tracker.log(step, values)

    def log_train(self, step: int, metrics: dict) -> None:
        loss = metrics["loss"]
        if math.isfinite(loss):
            s = self.smoothed
            self.smoothed = loss if s is None else self.smoothing * s + (1 - self.smoothing) * loss
        self._write(step, {"step": step, **metrics, "loss_smooth": self.smoothed})
        if self.console == "line":
            elapsed = time.perf_counter() - self.start
            eta = elapsed / max(step, 1) * (self.total_steps - step)
            log.info(
                "step %*d/%d | loss %.4f | lr %.2e | grad norm %.3f | %s tok/s%s | ETA %s",
                len(str(self.total_steps)),
                step,
                self.total_steps,
                loss,
                metrics["lr"],
                metrics["grad_norm"],
                f"{metrics['tokens_per_s']:,.0f}",
                speed_text(metrics),
                format_duration(eta),
            )

    def log_eval(self, step: int, val_loss: float) -> None:
        val_ppl = math.exp(min(val_loss, 50.0))
        self._write(step, {"step": step, "val_loss": val_loss, "val_ppl": val_ppl})
        if self.console == "line":
            log.info("step %d | val loss %.4f | val ppl %.1f", step, val_loss, val_ppl)

    def close(self, exit_code: int = 0) -> None:
        """End every tracker's run (failed when exit_code is not 0) and close metrics.jsonl, once.

        Thread-safe: a hard exit calls this from the watchdog's or the preemption timer's thread while the main
        thread may still log (records after the close are dropped) or close too (the second call does nothing).
        """
        with self._lock:
            if self._closed:
                return
            self._closed = True
            for tracker in self.trackers:
                try:
                    tracker.close(exit_code)
                except Exception as err:  # the other trackers and metrics.jsonl still get closed
                    log.warning("could not end the %s run: %s", tracker.name, err)
            self._file.close()
