"""What the debug presets switch on (conf/debug): one batch trained on again and again, autograd's anomaly mode,
deterministic kernels."""

import contextlib
import os
from collections.abc import Iterator
from typing import Any

import torch


class RepeatedBatches:
    """A loader that hands out its first `count` micro-batches again and again (train.overfit_batches); anything
    else (its state, metrics, lr scale) is the loader's own."""

    def __init__(self, loader: Any, count: int):
        self.loader, self.count = loader, count
        self.kept: list[Any] = []
        self.served = 0

    def next_batch(self) -> Any:
        if len(self.kept) < self.count:
            self.kept.append(self.loader.next_batch())
        batch = self.kept[self.served % self.count]
        self.served += 1
        return batch

    def __getattr__(self, name: str) -> Any:
        return getattr(self.loader, name)


@contextlib.contextmanager
def debug_modes(detect_anomaly: bool, deterministic: bool, device: torch.device) -> Iterator[None]:
    """train.detect_anomaly and train.deterministic for the block; torch's process-wide settings restored after
    (a trainer built in-process, in a test or a notebook, leaves them as it found them)."""
    was_deterministic = torch.are_deterministic_algorithms_enabled()
    was_benchmark = torch.backends.cudnn.benchmark
    if deterministic:
        if device.type == "cuda":
            # cuBLAS reads it when its handle is made: a later value is ignored, and without it cuBLAS raises
            os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")
            torch.backends.cudnn.benchmark = False
        torch.use_deterministic_algorithms(True)
    anomaly = torch.autograd.detect_anomaly(check_nan=True) if detect_anomaly else contextlib.nullcontext()
    try:
        with anomaly:
            yield
    finally:
        torch.use_deterministic_algorithms(was_deterministic)
        torch.backends.cudnn.benchmark = was_benchmark
