"""Tensor parallelism computed on plain local tensors, for layers whose shape the DTensor styles do not fit (an
MoE's routed experts and router, latent attention's shared low-rank projections).

Such a layer takes its sequence-sharded input all-gathered (`gather_sequence`: a plain tensor, the same on every tp
rank, whose gradient is declared partial and reduce-scattered), computes with this rank's part of each weight
(`local_linear` over a DTensor weight: sharded ones give this rank's columns or rows, replicated ones the whole
matrix with its gradient summed over the tp ranks) and returns partial sums (`scatter_sequence`: reduce-scattered
back along the sequence). Weights stay DTensors, so FSDP2, the optimizer and DCP see whole tensors.
"""

import types

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor, Partial, Replicate, Shard

from forge.parallel.expert import local_part


class SumGradOver(torch.autograd.Function):
    """Identity forward; the backward sums the gradient over `group` (every rank then holds the total)."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, group: dist.ProcessGroup) -> torch.Tensor:
        ctx.group = group
        return x.view_as(x)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        grad = grad.contiguous()
        dist.all_reduce(grad, group=ctx.group)
        return grad, None


class ScaleGrad(torch.autograd.Function):
    """Identity forward; the backward multiplies the gradient by `factor`."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, factor: float) -> torch.Tensor:
        ctx.factor = factor
        return x.view_as(x)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        return grad * ctx.factor, None


def shard_param(param: nn.Parameter, mesh: DeviceMesh, dim: int) -> nn.Parameter:
    """`param` as a DTensor sharded on `dim` over the 1-D `mesh` (this rank's contiguous block; meta stays meta)."""
    size, rank = mesh.size(), mesh.get_local_rank()
    full = param.detach()
    width = full.shape[dim] // size
    part = full.narrow(dim, rank * width, width).clone()
    return nn.Parameter(
        DTensor.from_local(part, mesh, [Shard(dim)], run_check=False, shape=full.shape, stride=full.stride())
    )


def replicate_param(param: nn.Parameter, mesh: DeviceMesh) -> nn.Parameter:
    """`param` as a DTensor replicated over `mesh`."""
    return nn.Parameter(DTensor.from_local(param.detach(), mesh, [Replicate()], run_check=False))


def summed_local(weight: DTensor) -> torch.Tensor:
    """A replicated weight's local tensor whose gradient, partial on each rank, is summed over its mesh."""
    return SumGradOver.apply(local_part(weight), weight.device_mesh.get_group())


def gather_sequence(x: DTensor, mesh: DeviceMesh) -> torch.Tensor:
    """A sequence-sharded activation, whole on every rank as a plain tensor; its gradient is partial."""
    return x.redistribute(mesh, [Replicate()]).to_local(grad_placements=[Partial()])


def scatter_sequence(partial: torch.Tensor, mesh: DeviceMesh) -> DTensor:
    """Each rank's partial sums, summed and sharded along the sequence (dim 1)."""
    return DTensor.from_local(partial, mesh, [Partial()], run_check=False).redistribute(mesh, [Shard(1)])


def local_linear(linear: nn.Linear, mesh: DeviceMesh, split: int | None) -> None:
    """Make `linear` compute with this rank's part of its weight: split 0 (its output features: this rank's
    columns, e.g. heads), 1 (its input features: a partial output) or None (replicated: the whole weight, whose
    gradient is summed over the tp ranks). The forward is bound to the module (a deepcopy runs its own weights)."""
    linear.weight = replicate_param(linear.weight, mesh) if split is None else shard_param(linear.weight, mesh, split)
    linear.summed = split is None
    linear.forward = types.MethodType(_local_linear_forward, linear)  # type: ignore[method-assign]


def _local_linear_forward(self: nn.Linear, x: torch.Tensor) -> torch.Tensor:
    return F.linear(x, summed_local(self.weight) if self.summed else local_part(self.weight))


def local_rms_norm(norm: nn.RMSNorm, mesh: DeviceMesh) -> None:
    """A replicated RMSNorm on a whole (plain) activation; its weight's partial gradient summed over the tp ranks."""
    norm.weight = replicate_param(norm.weight, mesh)
    norm.forward = types.MethodType(_local_rms_norm_forward, norm)  # type: ignore[method-assign]


def _local_rms_norm_forward(self: nn.RMSNorm, x: torch.Tensor) -> torch.Tensor:
    return F.rms_norm(x, self.normalized_shape, summed_local(self.weight), self.eps)
