"""Per-log-interval speed: step time, data-wait time, tokens/s, MFU and memory."""

import contextlib
import logging
import time
from collections.abc import Iterator

import torch

from forge.metrics.memory import memory_metrics
from forge.planning.peak import Peak

log = logging.getLogger("forge")


class StepMeter:
    """Times the steps of each log interval, leaving out what runs inside `paused()` (evaluation, checkpoints).

    MFU = flops_per_token * tokens/s / (peak FLOP/s of one device * world_size), with tokens/s over all ranks.
    """

    def __init__(
        self, device: torch.device, flops_per_token: float | None, peak: Peak | None = None, world_size: int = 1
    ):
        self.device = device
        self.flops_per_token = flops_per_token
        self.peak = peak
        self.world_size = world_size
        self.restart(0, 0)

    def restart(self, step: int, tokens_seen: int) -> None:
        """Start the first interval at `step` (after a resume, or at the start of the loop)."""
        self.last_time, self.last_step, self.last_tokens = time.perf_counter(), step, tokens_seen
        self.excluded = self.data_wait = 0.0

    @contextlib.contextmanager
    def paused(self) -> Iterator[None]:
        """Time spent inside is not part of any step."""
        start = time.perf_counter()
        try:
            yield
        finally:
            self.excluded += time.perf_counter() - start

    @contextlib.contextmanager
    def waiting_for_data(self) -> Iterator[None]:
        """Time spent inside counts as data wait (fetching the next batch from the loader)."""
        start = time.perf_counter()
        try:
            yield
        finally:
            self.data_wait += time.perf_counter() - start

    def interval(self, step: int, tokens_seen: int) -> dict[str, float]:
        """Metrics of the steps since the last call (waits for the device first)."""
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
        now = time.perf_counter()
        steps = max(step - self.last_step, 1)
        elapsed = max(now - self.last_time - self.excluded, 1e-9)
        tokens_per_s = (tokens_seen - self.last_tokens) / elapsed
        metrics = {
            "tokens_per_s": tokens_per_s,
            "step_time": elapsed / steps,
            "data_wait": self.data_wait / steps,
        }
        if self.flops_per_token is not None and self.peak is not None and self.peak.flops:
            achieved = self.flops_per_token * tokens_per_s / self.world_size
            if achieved > self.peak.flops and self.peak.remeasure is not None:
                log.warning(
                    "this run computes %.3g TFLOP/s per device, above the %s of %.3g: measuring the peak again",
                    achieved / 1e12,
                    self.peak.source,
                    self.peak.flops / 1e12,
                )
                self.peak = self.peak.remeasure()
                now = time.perf_counter()  # the measurement belongs to no step
            metrics["tflops_per_device"] = achieved / 1e12
            metrics["mfu"] = achieved / self.peak.flops
        metrics.update(memory_metrics(self.device))
        self.last_time, self.last_step, self.last_tokens = now, step, tokens_seen
        self.excluded = self.data_wait = 0.0
        return metrics


def describe_peak(flops_per_token: float | None, peak: Peak | None) -> None:
    """One start-up line: the FLOPs per token and where the peak comes from, or why MFU is not reported."""
    if flops_per_token is None:
        log.info("MFU not reported: the model's FLOPs per token are unknown (no TransformerArgs found)")
    elif peak is None or not peak.flops:
        reason = peak.source if peak else "not resolved on this rank"
        log.info("MFU not reported: peak FLOP/s %s", reason)
    else:
        log.info(
            "MFU: %.3g training FLOPs/token, peak %.2f TFLOP/s per device from %s",
            flops_per_token,
            peak.flops / 1e12,
            peak.source,
        )
