"""Tensor parallelism of an MoE feed-forward layer: every routed and shared expert's hidden width is split over the
tp ranks (w1 and w3 by columns, w2 by rows), as Megatron splits a dense MLP; the router is replicated.

The layer's input arrives sharded along the sequence (sequence parallel) and is all-gathered, so every tp rank routes
the same tokens the same way (its decisions, router losses and loads are one process's), runs its part of each
chosen expert's hidden width and ends with partial sums, which are reduce-scattered back along the sequence.

Gradients, per tp rank: the layer input's is partial (the experts' part of it, and 1/tp of the router's) and is
summed by the reduce-scatter that is the all-gather's backward; the router's logits take the sum over the tp ranks
of their partial combine-weight gradients (one all-reduce of a (tokens x experts) tensor per layer), so the gate's
weight gradient is whole and the same on every rank; the router losses, computed whole on every rank, give
1/tp of their gradient on each.
"""

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor, Partial, Replicate, Shard

from forge.model.feed_forward import FeedForward
from forge.model.moe import MoE
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


def split_hidden(param: nn.Parameter, mesh: DeviceMesh, dim: int) -> nn.Parameter:
    """`param` as a DTensor sharded on `dim` over the 1-D `mesh` (this rank's contiguous block; meta stays meta)."""
    size, rank = mesh.size(), mesh.get_local_rank()
    full = param.detach()
    width = full.shape[dim] // size
    part = full.narrow(dim, rank * width, width).clone()
    return nn.Parameter(
        DTensor.from_local(part, mesh, [Shard(dim)], run_check=False, shape=full.shape, stride=full.stride())
    )


def local_swiglu(ffn: FeedForward) -> None:
    """Run the shared experts on this rank's hidden columns (their weights are DTensors, their input a plain
    tensor): the same SwiGLU, with partial output."""

    def forward(x: torch.Tensor) -> torch.Tensor:
        w1, w2, w3 = (local_part(linear.weight) for linear in (ffn.w1, ffn.w2, ffn.w3))
        return F.linear(F.silu(F.linear(x, w1)) * F.linear(x, w3), w2)

    ffn.forward = forward  # type: ignore[method-assign]


def apply_moe_tensor_parallel(layer: MoE, tp_mesh: DeviceMesh) -> None:
    """Split `layer`'s experts' hidden widths over `tp_mesh` and install the hooks of the module docstring."""
    tp = tp_mesh.size()
    experts = layer.experts
    for name, dim in (("w1", 2), ("w3", 2), ("w2", 1)):  # (experts, dim, hidden) and (experts, hidden, dim)
        setattr(experts, name, split_hidden(getattr(experts, name), tp_mesh, dim))
    layer.dispatch = lambda x, counts, compute: compute(x, counts, local_part)  # type: ignore[call-arg]
    if layer.shared_experts is not None:
        shared = layer.shared_experts
        for linear, dim in ((shared.w1, 0), (shared.w3, 0), (shared.w2, 1)):  # nn.Linear: (out, in)
            linear.weight = split_hidden(linear.weight, tp_mesh, dim)
        local_swiglu(shared)

    def gather_tokens(module: nn.Module, args: tuple) -> tuple:
        (x,) = args
        return (x.redistribute(tp_mesh, [Replicate()]).to_local(grad_placements=[Partial()]),)

    def scatter_output(module: MoE, args: tuple, out: torch.Tensor) -> DTensor:
        for name in ("last_aux_loss", "last_z_loss"):
            loss = getattr(module, name)
            if loss is not None and loss.requires_grad:
                setattr(module, name, ScaleGrad.apply(loss, 1.0 / tp))
        return DTensor.from_local(out, tp_mesh, [Partial()], run_check=False).redistribute(tp_mesh, [Shard(1)])

    layer.register_forward_pre_hook(gather_tokens)
    layer.register_forward_hook(scatter_output)
    replicated_gate(layer.router.gate, tp_mesh)


def replicated_gate(gate: nn.Linear, tp_mesh: DeviceMesh) -> None:
    """The router's gate: a weight replicated over `tp_mesh` (a DTensor, as every other weight of the model is
    one: the optimizer takes them together), its logits' gradient summed over the tp ranks, its input's scaled by
    1/tp (the layer input's gradient is summed over them afterwards)."""
    tp, group = tp_mesh.size(), tp_mesh.get_group()
    gate.weight = nn.Parameter(DTensor.from_local(gate.weight.detach(), tp_mesh, [Replicate()], run_check=False))

    def forward(x: torch.Tensor) -> torch.Tensor:
        return SumGradOver.apply(F.linear(ScaleGrad.apply(x, 1.0 / tp), local_part(gate.weight)), group)

    gate.forward = forward  # type: ignore[method-assign]
