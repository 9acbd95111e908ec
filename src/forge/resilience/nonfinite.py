"""What to do when the loss or the gradient norm is NaN or infinite: never silently continue."""

import logging

import torch
import torch.distributed as dist

log = logging.getLogger("forge")


class NonFiniteError(RuntimeError):
    """A non-finite loss or gradient norm under the raise policy, or after the rollback budget is spent."""


class NonFinitePolicy:
    def __init__(self, policy: str, max_rollbacks: int):
        self.policy = policy
        self.max_rollbacks = max_rollbacks
        self.skipped = 0
        self.rollbacks = 0

    def describe(self, step: int, loss: torch.Tensor, grad_norm: torch.Tensor) -> str:
        return f"non-finite loss or gradient norm at step {step} (loss {loss.item()}, grad norm {grad_norm.item()})"


class StepFlags:
    """One step's (non-finite on any rank, stop signalled on any rank, labelled tokens summed over every rank, and
    on log steps every rank's busy time), as one SUM all-reduce of int64 on the training device, where separate
    checks would take a collective and a host sync each. Launching them costs no host sync: the host reads them
    (`read`) when it must, from a copy made as soon as the all-reduce is done (a pinned one on a GPU, behind an
    event), so reading step N's flags while step N + 1 is queued waits for step N only."""

    def __init__(
        self,
        step: int,
        loss: torch.Tensor,
        grad_norm: torch.Tensor,
        signalled: bool,
        tokens: torch.Tensor | None,
        busy: torch.Tensor | None = None,
    ):
        """`busy`: one int64 per rank, this rank's busy time at its index (forge.resilience.stragglers)."""
        self.step, self.loss, self.grad_norm = step, loss, grad_norm
        nonfinite = ~torch.isfinite(loss) | ~torch.isfinite(grad_norm)
        count = loss.new_zeros((), dtype=torch.int64) if tokens is None else tokens.to(loss.device, torch.int64)
        signal = torch.full((), int(signalled), dtype=torch.int64, device=loss.device)  # filled there: no copy
        flags = torch.stack([nonfinite.reshape(()).to(torch.int64), signal, count.reshape(())])
        if busy is not None:
            flags = torch.cat([flags, busy])
        if dist.is_initialized() and dist.get_world_size() > 1:
            dist.all_reduce(flags)
        self.device_flags = flags
        self.world_tokens = flags[2] if tokens is not None else None
        """Every rank's labelled tokens summed (tensor-parallel peers each add theirs), on the device; None when
        the step passed no count."""
        self.event = None
        if flags.is_cuda:
            self.host = torch.empty(flags.shape, dtype=flags.dtype, pin_memory=True)
            self.host.copy_(flags, non_blocking=True)
            self.event = torch.cuda.Event()
            self.event.record()
        else:
            self.host = flags

    def finite(self) -> torch.Tensor:
        """1.0 on the device when no rank saw a non-finite value, else 0.0 (no host sync)."""
        return (self.device_flags[0] == 0).to(torch.float32)

    def read(self) -> tuple[bool, bool]:
        """(any rank non-finite, any rank signalled): the host waits for this step's all-reduce, not for later
        work."""
        if self.event is not None:
            self.event.synchronize()
        bad, stop, _, *busy = self.host.tolist()
        self.busy_us = busy or None
        """Every rank's busy time (microseconds per step) when the step carried it."""
        return bad > 0, stop > 0
