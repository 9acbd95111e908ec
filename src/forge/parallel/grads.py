"""Gradient handling that differs under sharding: reduction during accumulation, and the global norm."""

import math

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.fsdp import FSDPModule
from torch.distributed.tensor import DTensor


def set_gradient_sync(model: nn.Module, enabled: bool) -> None:
    """Turn FSDP's gradient reduction on or off (off for all but the last micro-batch of an accumulation)."""
    if isinstance(model, FSDPModule):
        model.set_requires_gradient_sync(enabled)


def clip_grad_norm(model: nn.Module, max_norm: float, pp_group: dist.ProcessGroup | None = None) -> torch.Tensor:
    """Clip to the global norm over all shards (max_norm <= 0 only measures it); returns it as a plain tensor.

    With pipeline parallelism each rank holds other parameters: the squared norms are summed over `pp_group`.
    """
    if pp_group is None:
        norm = nn.utils.clip_grad_norm_(model.parameters(), max_norm if max_norm > 0 else math.inf)
        # Over DTensor gradients the norm is itself a DTensor; its full value is the norm of the whole model.
        return norm.full_tensor() if isinstance(norm, DTensor) else norm
    params = [p for p in model.parameters() if p.grad is not None]
    norm = nn.utils.get_total_norm([p.grad for p in params])
    norm = norm.full_tensor() if isinstance(norm, DTensor) else norm
    squared = norm.float() ** 2
    dist.all_reduce(squared, group=pp_group)
    norm = squared.sqrt()
    if max_norm > 0:
        nn.utils.clip_grads_with_norm_(params, max_norm, norm)
    return norm
