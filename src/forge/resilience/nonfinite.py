"""What to do when the loss or the gradient norm is NaN or infinite: never silently continue."""

import logging

import torch
import torch.distributed as dist

log = logging.getLogger("forge")

POLICIES = ("warn", "skip", "raise", "rollback")


class NonFiniteError(RuntimeError):
    """A non-finite loss or gradient norm under the raise policy, or after the rollback budget is spent."""


class NonFinitePolicy:
    def __init__(self, policy: str, max_rollbacks: int):
        self.policy = policy
        self.max_rollbacks = max_rollbacks
        self.skipped = 0
        self.rollbacks = 0

    @staticmethod
    def is_bad(loss: torch.Tensor, grad_norm: torch.Tensor) -> bool:
        """True on every rank when any rank saw a non-finite loss or gradient norm (one host sync)."""
        bad = (~torch.isfinite(loss) | ~torch.isfinite(grad_norm)).to(torch.int32).reshape(1)
        if dist.is_initialized() and dist.get_world_size() > 1:
            dist.all_reduce(bad, op=dist.ReduceOp.MAX)
        return bool(bad.item())

    def describe(self, step: int, loss: torch.Tensor, grad_norm: torch.Tensor) -> str:
        return f"non-finite loss or gradient norm at step {step} (loss {loss.item()}, grad norm {grad_norm.item()})"
