"""Expert parallelism: each rank of an `ep` group keeps num_experts / ep experts of every MoE layer.

The model code stays free of torch.distributed: `apply_expert_parallel` slices each MoE layer's stacked expert
weights and replaces the layer's `dispatch` callable with `ExpertParallelDispatch`, which

1. exchanges how many tokens every rank sends to every expert (all_to_all_single on the counts),
2. sends the tokens, already grouped by global expert, to the ranks owning those experts (uneven all_to_all_single
   with autograd; the token order on the wire is (source rank, local expert)),
3. regroups them by local expert, runs the local experts, undoes the regrouping,
4. sends the outputs back the same way; the layer then combines them with the routing weights as before.

Router, attention and every other weight stay replicated over the group; their gradients are averaged by data
parallelism as usual. Expert weights receive the gradient of every rank's tokens that visited them.

Two ways in: `apply_expert_parallel(model, group)` keeps plain per-rank slices (the standalone building block),
and `shard_experts(model, ep_mesh)` (the parallel plan's) makes the stacked expert weights DTensors sharded on
dim 0 over the `ep` mesh dimension, so FSDP2 can shard them further and DCP saves them as whole tensors.
"""

from collections.abc import Callable

import torch
import torch.distributed as dist
import torch.distributed._functional_collectives as funcol
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor, Shard

from forge.models.common.moe import moe_layers
from forge.models.common.moe.dispatch import ExpertCompute
from forge.parallel.mesh import token_mesh


class ExpertParallelDispatch:
    """MoE `dispatch` that runs the experts on their owning ranks of `group`."""

    def __init__(self, group: dist.ProcessGroup, num_experts: int):
        self.group = group
        self.ep = dist.get_world_size(group)
        self.num_local = num_experts // self.ep

    def __call__(self, x: torch.Tensor, counts: torch.Tensor, experts: ExpertCompute) -> torch.Tensor:
        """x (N, dim) grouped by global expert, counts (num_experts,) -> expert outputs in the order of x."""
        # recv[r, e]: tokens rank r sends to my local expert e.
        recv = torch.empty_like(counts)
        dist.all_to_all_single(recv, counts, group=self.group)
        recv = recv.view(self.ep, self.num_local)
        send_splits = counts.view(self.ep, self.num_local).sum(dim=1).tolist()
        recv_splits = recv.sum(dim=1).tolist()
        received = funcol.all_to_all_single_autograd(x, recv_splits, send_splits, self.group)
        local_ids = torch.arange(self.num_local, device=x.device).repeat(self.ep)
        by_expert = torch.argsort(local_ids.repeat_interleave(recv.flatten()), stable=True)
        out = experts(received[by_expert], recv.sum(dim=0), local_part)
        back = torch.empty_like(by_expert)
        back[by_expert] = torch.arange(by_expert.numel(), device=x.device)
        return funcol.all_to_all_single_autograd(out[back], send_splits, recv_splits, self.group)


def apply_expert_parallel(model: nn.Module, ep: dist.ProcessGroup | DeviceMesh) -> nn.Module:
    """Shard every MoE layer's experts over `ep` (a process group or a 1-D mesh) and install the dispatch.

    Works on the meta device (before `to_empty` + `init_weights`, which then initialises each rank's slice exactly
    as the whole model would be initialised) and on a materialised model (each rank keeps its slice of the values).
    Expert weights become (num_experts / ep, ...) plain tensors; sharding them further with FSDP is the plan's job.
    """
    group = ep.get_group() if isinstance(ep, DeviceMesh) else ep
    size, rank = dist.get_world_size(group), dist.get_rank(group)
    for _, layer in moe_layers(model):
        num_experts = layer.args.num_experts
        if num_experts % size:
            raise ValueError(f"model.moe.num_experts={num_experts} is not divisible by the ep degree {size}")
        local = num_experts // size
        layer.experts.keep_slice(rank * local, local)
        layer.dispatch = ExpertParallelDispatch(group, num_experts)
    return model


def local_part(weight: torch.Tensor) -> torch.Tensor:
    """This rank's experts of a stacked expert weight (differentiable; a plain tensor is already local)."""
    return weight.to_local() if isinstance(weight, DTensor) else weight


def shard_experts(model: nn.Module, ep_mesh: DeviceMesh, ep_tp_mesh: DeviceMesh | None = None) -> int:
    """Make every MoE layer's w1/w2/w3 a DTensor sharded on the expert dimension over the 1-D `ep_mesh` and
    install the all-to-all dispatch; returns the number of MoE layers.

    Rank r of the mesh keeps experts [r * E / ep, (r + 1) * E / ep). On the meta device only shapes change; the
    values come later from the plan's initialisation (`forge.parallel.init`), which splits the whole model's.
    Experts whose hidden widths tensor parallelism split already (DTensors over tp) become DTensors over the 2-D
    `ep_tp_mesh` (ep, tp): this rank's experts, its part of each width. The all-to-all then runs between the ranks
    of one tp index, each sending its tp group's (identical) tokens, and the partial outputs come back to be summed
    over tp as without ep.
    """
    size, rank = ep_mesh.size(), ep_mesh.get_local_rank()
    layers = moe_layers(model)
    for _, layer in layers:
        experts, num_experts = layer.experts, layer.args.num_experts
        if num_experts % size:
            raise ValueError(f"model.moe.num_experts={num_experts} is not divisible by the ep degree {size}")
        local = num_experts // size
        for name in ("w1", "w2", "w3"):
            weight = getattr(experts, name).detach()
            mesh, placements = ep_mesh, [Shard(0)]
            if isinstance(weight, DTensor):  # split over tp: (ep, tp) placements
                if ep_tp_mesh is None:
                    raise ValueError("tensor-parallel experts need the (ep, tp) mesh to be split over ep")
                mesh, placements = ep_tp_mesh, [Shard(0), *weight.placements]
            held = weight.to_local() if isinstance(weight, DTensor) else weight
            part = held[rank * local : (rank + 1) * local].clone()
            sharded = DTensor.from_local(
                part, mesh, placements, run_check=False, shape=weight.shape, stride=weight.stride()
            )
            setattr(experts, name, nn.Parameter(sharded))
        experts.first, experts.num_local = rank * local, local
        layer.dispatch = ExpertParallelDispatch(ep_mesh.get_group(), num_experts)
    return len(layers)


def summed_over(group: dist.ProcessGroup):
    """A function summing a (count) tensor over `group`, without gradient."""

    def total(counts: torch.Tensor) -> torch.Tensor:
        summed = counts.detach().clone()
        dist.all_reduce(summed, group=group)
        return summed

    return total


def sum_load_over(group: dist.ProcessGroup, model: nn.Module) -> int:
    """Give every MoE layer with `aux_loss_scope=global_batch` the sum of its expert counts over `group` (the
    ranks holding a step's tokens: data-parallel, and their context-parallel peers); returns how many layers got
    it."""
    layers = [layer for _, layer in moe_layers(model) if layer.args.aux_loss_scope == "global_batch"]
    for layer in layers:
        layer.sum_load = summed_over(group)
    return len(layers)


def sum_sequence_counts_over(group: dist.ProcessGroup, model: nn.Module) -> int:
    """Give every MoE layer the sum of its micro-batch or per-sequence expert counts over `group` (the
    context-parallel ranks, which hold the other parts of the same sequences); returns how many layers got it."""
    layers = [layer for _, layer in moe_layers(model)]
    for layer in layers:
        layer.sum_sequence_counts = summed_over(group)
    return len(layers)


def sum_over_token_ranks_in_place(mesh: DeviceMesh | None) -> Callable[[torch.Tensor], None]:
    """An in-place sum over the ranks holding different tokens of a step (dp x cp; forge.parallel.mesh.token_mesh),
    for the routers' bias update and load metrics. Not over the world: pipeline stages hold different layers, whose
    loads must not be added, and tensor-parallel peers route the same tokens."""
    tokens = token_mesh(mesh)
    group = tokens.get_group() if tokens is not None and tokens.size() > 1 else None

    def reduce(tensor: torch.Tensor) -> None:
        if group is not None:
            dist.all_reduce(tensor, group=group)

    return reduce
