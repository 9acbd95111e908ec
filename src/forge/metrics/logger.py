"""metrics.jsonl (always) and the console line."""

import json
import logging
import math
import time
from pathlib import Path

log = logging.getLogger("forge")


def format_duration(seconds: float) -> str:
    seconds = int(max(0, seconds))
    hours, rest = divmod(seconds, 3600)
    minutes, secs = divmod(rest, 60)
    return f"{hours}:{minutes:02d}:{secs:02d}" if hours else f"{minutes:02d}:{secs:02d}"


class MetricsLogger:
    """Appends one JSON object per record to run_dir/metrics.jsonl and prints a console line."""

    def __init__(self, run_dir: Path, total_steps: int, console: str = "line", smoothing: float = 0.9):
        self.path = Path(run_dir) / "metrics.jsonl"
        self.path.parent.mkdir(parents=True, exist_ok=True)
        self._file = self.path.open("a", encoding="utf-8")
        self.total_steps = total_steps
        self.console = console
        self.smoothing = smoothing
        self.smoothed: float | None = None
        self.start = time.perf_counter()

    def _write(self, record: dict) -> None:
        self._file.write(json.dumps(record) + "\n")
        self._file.flush()

    def log_train(self, step: int, metrics: dict) -> None:
        loss = metrics["loss"]
        if math.isfinite(loss):
            s = self.smoothed
            self.smoothed = loss if s is None else self.smoothing * s + (1 - self.smoothing) * loss
        record = {"step": step, **metrics, "loss_smooth": self.smoothed}
        self._write(record)
        if self.console == "line":
            elapsed = time.perf_counter() - self.start
            eta = elapsed / max(step, 1) * (self.total_steps - step)
            log.info(
                "step %*d/%d | loss %.4f | lr %.2e | grad norm %.3f | %s tok/s | ETA %s",
                len(str(self.total_steps)),
                step,
                self.total_steps,
                loss,
                metrics["lr"],
                metrics["grad_norm"],
                f"{metrics['tokens_per_s']:,.0f}",
                format_duration(eta),
            )

    def log_eval(self, step: int, val_loss: float) -> None:
        self._write({"step": step, "val_loss": val_loss, "val_ppl": math.exp(min(val_loss, 50.0))})
        if self.console == "line":
            log.info("step %d | val loss %.4f | val ppl %.1f", step, val_loss, math.exp(min(val_loss, 50.0)))

    def close(self) -> None:
        self._file.close()
