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


def step_flags(loss: torch.Tensor, grad_norm: torch.Tensor, signalled: bool) -> tuple[bool, bool]:
    """(any rank saw a non-finite loss or gradient norm, any rank was signalled to stop): one MAX all-reduce of two
    flags over every rank and one host sync per step, where separate checks would take two of each."""
    flags = torch.stack([(~torch.isfinite(loss) | ~torch.isfinite(grad_norm)).reshape(()), loss.new_tensor(signalled)])
    flags = flags.to(torch.int32)
    if dist.is_initialized() and dist.get_world_size() > 1:
        dist.all_reduce(flags, op=dist.ReduceOp.MAX)
    bad, stop = flags.tolist()
    return bool(bad), bool(stop)
