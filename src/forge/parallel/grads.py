"""Gradient handling that differs under sharding: reduction during accumulation, and the global norm."""

from collections.abc import Iterable

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.fsdp import FSDPModule
from torch.distributed.tensor import DTensor, Replicate


def set_gradient_sync(model: nn.Module, enabled: bool) -> None:
    """Turn FSDP's gradient reduction on or off (off for all but the last micro-batch of an accumulation)."""
    if isinstance(model, FSDPModule):
        model.set_requires_gradient_sync(enabled)


def clip_grad_norm(
    model: nn.Module,
    max_norm: float,
    pp_group: dist.ProcessGroup | None = None,
    counted_elsewhere: Iterable[torch.Tensor] = (),
) -> torch.Tensor:
    """Clip to the global norm over all shards (max_norm <= 0 only measures it); returns it as a plain tensor.

    The norm is summed, in float64, from each rank's local squares, all-reduced over the mesh dimensions a
    gradient is sharded along (never along a replicated one), one group of gradients with the same mesh and
    placements at a time: a few collectives per step, no host sync. float32 norms of large gradients are off by
    up to ~2e-4 relative on the CPU (seen on an 8192 x 64 head), differently for a whole matrix and its shards;
    one tensor at a time is upcast (on a CPU one chunk of it), so the extra memory is one local gradient. With
    pipeline parallelism each rank holds other parameters, so the squares are summed over `pp_group` too;
    `counted_elsewhere` are clipped but left out of this rank's squares (a tied embedding that two stages hold).
    Expert gradients live on another mesh than the rest; grouping by mesh covers them.
    """
    params = [p for p in model.parameters() if p.grad is not None]
    _reduce_partial_grads(params)
    groups = _group_by_layout(params)
    skip = {id(p) for p in counted_elsewhere}
    squared = torch.zeros((), dtype=torch.float64, device=params[0].grad.device if params else None)
    for (mesh, placements), group in groups.items():
        counted = [p for p in group if id(p) not in skip]
        if counted:
            squared = squared + _squared_sum(counted, mesh, placements)
    if pp_group is not None:
        dist.all_reduce(squared, group=pp_group)
    norm = squared.sqrt().float()
    if max_norm > 0:
        for group in groups.values():  # one foreach op cannot mix meshes
            nn.utils.clip_grads_with_norm_(group, max_norm, norm)
    return norm


@torch.no_grad()
def scale_grads(model: nn.Module, factor: torch.Tensor) -> None:
    """Multiply every gradient by `factor` (a 0-d tensor), in place, on each rank's local shards."""
    grads = [p.grad.to_local() if isinstance(p.grad, DTensor) else p.grad for p in model.parameters()]
    by_device: dict[torch.device, list[torch.Tensor]] = {}
    for grad in grads:
        if grad is not None:
            by_device.setdefault(grad.device, []).append(grad)
    for device, group in by_device.items():
        torch._foreach_mul_(group, factor.to(device))


def _reduce_partial_grads(params: list[torch.Tensor]) -> None:
    """Gradients DTensor left as pending sums (replicated weights fed by sequence-parallel activations, under TP
    alone) are reduced now, in place, so the norm and the optimizer see whole values; a no-op otherwise."""
    for p in params:
        grad = p.grad
        if isinstance(grad, DTensor) and any(pl.is_partial() for pl in grad.placements):
            whole = [Replicate() if pl.is_partial() else pl for pl in grad.placements]
            p.grad = grad.redistribute(placements=whole)


def _group_by_layout(params: list[torch.Tensor]) -> dict:
    """Parameters keyed by (mesh, placements) of their gradient ((None, ()) for plain tensors), in first-seen order."""
    groups: dict = {}
    for p in params:
        grad = p.grad
        key = (grad.device_mesh, tuple(grad.placements)) if isinstance(grad, DTensor) else (None, ())
        groups.setdefault(key, []).append(p)
    return groups


# On a CPU the float64 copy of a gradient is made a chunk at a time: a whole copy of a large gradient would be a
# fresh mapping from malloc, a page fault per 4 KiB; a chunk's copy reuses memory the allocator keeps
CPU_CHUNK_ELEMENTS = 1 << 19


def _float64_squares(grad: torch.Tensor) -> torch.Tensor:
    """The sum of the squared entries of one gradient, accumulated in float64."""
    flat = grad.reshape(-1)
    step = CPU_CHUNK_ELEMENTS if grad.device.type == "cpu" else max(flat.numel(), 1)
    parts = [torch.linalg.vector_norm(flat[i : i + step], dtype=torch.float64) for i in range(0, flat.numel(), step)]
    return torch.stack(parts).square().sum() if parts else flat.new_zeros((), dtype=torch.float64)


def _squared_sum(params: list[torch.Tensor], mesh, placements: tuple) -> torch.Tensor:
    """Sum of the squared entries of these parameters' whole gradients."""
    local = [p.grad.to_local() if isinstance(p.grad, DTensor) else p.grad for p in params]
    total = torch.stack([_float64_squares(g) for g in local]).sum()
    for dim, placement in enumerate(placements):
        if not placement.is_replicate():
            dist.all_reduce(total, group=mesh.get_group(dim))
    return total
