"""Tensor parallelism of an MoE feed-forward layer: every routed and shared expert's hidden width is split over the
tp ranks (w1 and w3 by columns, w2 by rows), as Megatron splits a dense MLP; the router is replicated.

The layer's input arrives sharded along the sequence (sequence parallel) and is all-gathered, so every tp rank routes
the same tokens the same way (its decisions, router losses and loads are one process's), runs its part of each
chosen expert's hidden width and ends with partial sums, which are reduce-scattered back along the sequence
(forge.parallel.local_tp).

Gradients, per tp rank: the layer input's is partial (the experts' part of it, and 1/tp of the router's) and is
summed by the reduce-scatter that is the all-gather's backward; the router's logits take the sum over the tp ranks
of their partial combine-weight gradients (one all-reduce of a (tokens x experts) tensor per layer), so the gate's
weight gradient is whole and the same on every rank; the router losses, computed whole on every rank, give
1/tp of their gradient on each.
"""

import types

import torch
import torch.nn.functional as F
from torch import nn
from torch.distributed.device_mesh import DeviceMesh

from forge.models.common.moe import MoE
from forge.parallel.expert import local_part
from forge.parallel.local_tp import (
    ScaleGrad,
    SumGradOver,
    gather_sequence,
    local_linear,
    replicate_param,
    scatter_sequence,
    shard_param,
)


def apply_moe_tensor_parallel(layer: MoE, tp_mesh: DeviceMesh) -> None:
    """Split `layer`'s experts' hidden widths over `tp_mesh` and install the hooks of the module docstring."""
    tp = tp_mesh.size()
    experts = layer.experts
    for name, dim in (("w1", 2), ("w3", 2), ("w2", 1)):  # (experts, dim, hidden) and (experts, hidden, dim)
        setattr(experts, name, shard_param(getattr(experts, name), tp_mesh, dim))
    layer.dispatch = lambda x, counts, compute: compute(x, counts, local_part)  # type: ignore[call-arg]
    if layer.shared_experts is not None:
        shared = layer.shared_experts
        for linear, split in ((shared.w1, 0), (shared.w3, 0), (shared.w2, 1)):  # nn.Linear: (out, in)
            local_linear(linear, tp_mesh, split)

    def scatter_output(module: MoE, args: tuple, out: torch.Tensor):
        for name in ("last_aux_loss", "last_z_loss"):
            loss = getattr(module, name)
            if loss is not None and loss.requires_grad:
                setattr(module, name, ScaleGrad.apply(loss, 1.0 / tp))
        return scatter_sequence(out, tp_mesh)

    layer.register_forward_pre_hook(lambda module, args: (gather_sequence(args[0], tp_mesh),))
    layer.register_forward_hook(scatter_output)
    replicated_gate(layer.router.gate, tp_mesh)


def replicated_gate(gate: nn.Linear, tp_mesh: DeviceMesh) -> None:
    """The router's gate: a weight replicated over `tp_mesh`, its logits' gradient summed over the tp ranks (the
    combine weights' part is partial, the router losses' 1/tp on each), its input's scaled by 1/tp (the layer
    input's gradient is summed over the ranks afterwards)."""
    gate.weight = replicate_param(gate.weight, tp_mesh)
    gate.forward = types.MethodType(_gate_forward, gate)  # type: ignore[method-assign]


def _gate_forward(self: nn.Linear, x: torch.Tensor) -> torch.Tensor:
    mesh = self.weight.device_mesh
    logits = F.linear(ScaleGrad.apply(x, 1.0 / mesh.size()), local_part(self.weight))
    return SumGradOver.apply(logits, mesh.get_group())
