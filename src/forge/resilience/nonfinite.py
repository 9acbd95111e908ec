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


def step_flags(
    loss: torch.Tensor, grad_norm: torch.Tensor, signalled: bool, tokens: torch.Tensor | None = None
) -> tuple[bool, bool, int | None]:
    """(any rank saw a non-finite loss or gradient norm, any rank was signalled to stop, the sum of every rank's
    `tokens` or None): one SUM all-reduce of three integers over every rank and one host sync per step, where
    separate checks would take a collective and a sync each. `tokens` is a step's labelled-token count, which
    ranks holding the same tokens (tensor-parallel peers) each add."""
    nonfinite = ~torch.isfinite(loss) | ~torch.isfinite(grad_norm)
    count = loss.new_zeros((), dtype=torch.int64) if tokens is None else tokens.to(loss.device, torch.int64)
    flags = torch.stack([nonfinite.reshape(()).to(torch.int64), loss.new_tensor(int(signalled), dtype=torch.int64),
                         count.reshape(())])  # fmt: skip
    if dist.is_initialized() and dist.get_world_size() > 1:
        dist.all_reduce(flags)
    bad, stop, total = flags.tolist()
    return bad > 0, stop > 0, None if tokens is None else total
