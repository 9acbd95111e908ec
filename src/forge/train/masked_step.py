"""An optimizer step that applies on the device only when the step was finite, so the host need not read the
non-finite check before stepping."""

from collections.abc import Iterator
from contextlib import contextmanager

import torch


def masks_on_device(optimizer: torch.optim.Optimizer) -> bool:
    """torch's fused Adam and AdamW take GradScaler's `found_inf` tensor: on 1 the kernel leaves the parameters,
    the moments and the step count as they were. Other optimizers need the host to decide (fused SGD also takes
    it, but a skipped first step leaves its momentum buffers uninitialised, and it has no DTensor rule for FSDP)."""
    fused_adam = isinstance(optimizer, torch.optim.Adam | torch.optim.AdamW) and bool(optimizer.defaults.get("fused"))
    return fused_adam and bool(getattr(optimizer, "_step_supports_amp_scaling", False))


@contextmanager
def applied_where(optimizer: torch.optim.Optimizer, mask: torch.Tensor | None) -> Iterator[None]:
    """Within it, `optimizer.step()` applies its update only where the 0-dim `mask` is 1.0 (None: always)."""
    if mask is None:
        yield
        return
    optimizer.found_inf = 1.0 - mask  # type: ignore[attr-defined]
    try:
        yield
    finally:
        del optimizer.found_inf  # type: ignore[attr-defined]
