"""Learning-rate schedules as LambdaLR factories (`_partial_: true` targets in conf/scheduler)."""

import math

from torch.optim import Optimizer
from torch.optim.lr_scheduler import LambdaLR


def _warmup(step: int, warmup_steps: int) -> float:
    return (step + 1) / (warmup_steps + 1)


def warmup_constant(optimizer: Optimizer, warmup_steps: int) -> LambdaLR:
    """Linear warmup, then constant."""
    return LambdaLR(optimizer, lambda s: _warmup(s, warmup_steps) if s < warmup_steps else 1.0)


def _decay(warmup_steps: int, total_steps: int, min_lr_ratio: float, shape):
    def factor(step: int) -> float:
        if step < warmup_steps:
            return _warmup(step, warmup_steps)
        progress = min(1.0, (step - warmup_steps) / max(1, total_steps - warmup_steps))
        return min_lr_ratio + (1.0 - min_lr_ratio) * shape(progress)

    return factor


def warmup_cosine(optimizer: Optimizer, warmup_steps: int, total_steps: int, min_lr_ratio: float) -> LambdaLR:
    """Linear warmup, then cosine decay to min_lr_ratio at total_steps."""
    shape = lambda p: 0.5 * (1.0 + math.cos(math.pi * p))  # noqa: E731
    return LambdaLR(optimizer, _decay(warmup_steps, total_steps, min_lr_ratio, shape))


def warmup_linear(optimizer: Optimizer, warmup_steps: int, total_steps: int, min_lr_ratio: float) -> LambdaLR:
    """Linear warmup, then linear decay to min_lr_ratio at total_steps."""
    return LambdaLR(optimizer, _decay(warmup_steps, total_steps, min_lr_ratio, lambda p: 1.0 - p))


def warmup_stable_decay(
    optimizer: Optimizer, warmup_steps: int, total_steps: int, min_lr_ratio: float, decay_fraction: float
) -> LambdaLR:
    """Warmup, a plateau at the peak, then linear decay to min_lr_ratio over the last decay_fraction."""
    decay_start = int(total_steps * (1.0 - decay_fraction))

    def factor(step: int) -> float:
        if step < warmup_steps:
            return _warmup(step, warmup_steps)
        if step < decay_start:
            return 1.0
        progress = min(1.0, (step - decay_start) / max(1, total_steps - decay_start))
        return 1.0 - (1.0 - min_lr_ratio) * progress

    return LambdaLR(optimizer, factor)
