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
    With expert parallelism the expert gradients are DTensors on another mesh ((dp_shard_mod_ep, ep)) than the
    rest (dp_shard); one norm cannot mix meshes, so each mesh's norm is made whole and the squares are summed.
    """
    params = [p for p in model.parameters() if p.grad is not None]
    by_mesh = _group_by_mesh(params)
    if pp_group is None and len(by_mesh) <= 1:
        norm = nn.utils.clip_grad_norm_(params, max_norm if max_norm > 0 else math.inf)
        # Over DTensor gradients the norm is itself a DTensor; its full value is the norm of the whole model.
        return norm.full_tensor() if isinstance(norm, DTensor) else norm
    squared = torch.zeros(())
    for group in by_mesh.values():
        squared = squared.to(group[0].device) + _whole_norm(group).float() ** 2
    if pp_group is not None:
        dist.all_reduce(squared, group=pp_group)
    norm = squared.sqrt()
    if max_norm > 0:
        for group in by_mesh.values():  # one foreach op cannot mix meshes either
            nn.utils.clip_grads_with_norm_(group, max_norm, norm)
    return norm


def _group_by_mesh(params: list[torch.Tensor]) -> dict:
    """Parameters keyed by the device mesh of their gradient (None for plain tensors), in first-seen order."""
    groups: dict = {}
    for p in params:
        groups.setdefault(p.grad.device_mesh if isinstance(p.grad, DTensor) else None, []).append(p)
    return groups


def _whole_norm(params: list[torch.Tensor]) -> torch.Tensor:
    norm = nn.utils.get_total_norm([p.grad for p in params])
    return norm.full_tensor() if isinstance(norm, DTensor) else norm
