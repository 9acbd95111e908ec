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
from forge.models.common.moe.dispatch import ExpertCompute, inverse, permute_rows
from forge.parallel.mesh import token_mesh


class ExpertParallelDispatch:
    """MoE `dispatch` that runs the experts on their owning ranks of `group`.

    With `chunks` > 1 each expert's rows are split into that many parts, and every part travels on its own: all
    parts' all-to-alls are issued at once (asynchronous functional collectives), so part i + 1 is on the wire
    while part i's experts compute, and part i's outputs travel back while part i + 1's compute.
    """

    def __init__(self, group: dist.ProcessGroup, num_experts: int, chunks: int = 1):
        self.group = group
        self.ep = dist.get_world_size(group)
        self.num_local = num_experts // self.ep
        self.chunks = chunks

    def __call__(self, x: torch.Tensor, counts: torch.Tensor, experts: ExpertCompute) -> torch.Tensor:
        """x (M, dim) grouped by global expert, counts (num_experts,) kept rows per expert (rows past their sum
        are dropped assignments: they stay here, with zero outputs) -> expert outputs in the order of x."""
        ep, local, chunks = self.ep, self.num_local, self.chunks
        # sizes[c, e]: expert e's rows in part c, each expert's rows split in order and as evenly as they go.
        bounds = counts * torch.arange(chunks + 1, device=counts.device).unsqueeze(1) // chunks
        sizes = bounds.diff(dim=0)
        send = sizes.view(chunks, ep, local).transpose(0, 1).contiguous()
        recv = torch.empty_like(send)  # recv[r, c, e]: rows rank r sends in part c to my local expert e
        dist.all_to_all_single(recv, send, group=self.group)
        send_splits, recv_splits = torch.stack([send.sum(-1), recv.sum(-1)]).tolist()  # the layer's one host sync
        kept = sum(map(sum, send_splits))
        order = self.part_order(counts, kept) if chunks > 1 else None
        outgoing = x[:kept] if order is None else x[:kept][order]

        part_sizes = [sum(row[c] for row in send_splits) for c in range(chunks)]
        parts_out = [[row[c] for row in send_splits] for c in range(chunks)]
        parts_in = [[row[c] for row in recv_splits] for c in range(chunks)]
        received = [
            funcol.all_to_all_single_autograd(part, parts_in[c], parts_out[c], self.group)
            for c, part in enumerate(outgoing.split(part_sizes))
        ]
        returned = []
        for c, part in enumerate(received):
            out = self.run_local(part, recv[:, c], experts)
            returned.append(funcol.all_to_all_single_autograd(out, parts_out[c], parts_in[c], self.group))
        out = torch.cat(returned) if chunks > 1 else returned[0]
        if order is not None:
            out = torch.empty_like(out).index_copy(0, order, out)
        dropped = x.shape[0] - kept
        return torch.cat([out, out.new_zeros(dropped, out.shape[-1])]) if dropped else out

    def part_order(self, counts: torch.Tensor, kept: int) -> torch.Tensor:
        """The permutation of the kept rows (grouped by expert) that puts them part by part, each part still grouped
        by expert: row p of an expert with n rows belongs to part floor(((p + 1) * chunks - 1) / n)."""
        experts = torch.arange(counts.numel(), device=counts.device)
        expert = torch.repeat_interleave(experts, counts, output_size=kept)
        position = torch.arange(kept, device=counts.device) - (counts.cumsum(0) - counts)[expert]
        part = ((position + 1) * self.chunks - 1) // counts[expert]
        return torch.argsort(part, stable=True)

    def run_local(self, received: torch.Tensor, recv: torch.Tensor, experts: ExpertCompute) -> torch.Tensor:
        """Rows from every rank, (source rank, local expert) order -> this rank's experts' outputs, same order."""
        local_ids = torch.arange(self.num_local, device=received.device).repeat(self.ep)
        owner = local_ids.repeat_interleave(recv.flatten(), output_size=received.shape[0])
        by_expert = torch.argsort(owner, stable=True)
        out = experts(received[by_expert], recv.sum(dim=0), local_part)
        return torch.empty_like(out).index_copy(0, by_expert, out)


class SplitRowsOverTp:
    """MoE `dispatch` under expert parallelism spanning the tensor-parallel ranks (parallel.ep_spans_tp).

    Every tp rank routes the same tokens (the layer gathers the sequence first); rank t of the tp group sends part t
    of each expert's rows (its rows split in order, as evenly as they go) through `inner`, which treats the other
    parts as dropped rows (zero outputs, nothing sent). Each rank's outputs are thus partial, and the layer sums
    them over the tp ranks (its reduce-scatter back along the sequence), as it sums width-split experts' partial
    sums. Every row is computed once in the tp group; no host sync beyond `inner`'s."""

    def __init__(self, inner: ExpertParallelDispatch, tp_rank: int, tp: int):
        self.inner, self.tp_rank, self.tp = inner, tp_rank, tp

    def __call__(self, x: torch.Tensor, counts: torch.Tensor, experts: ExpertCompute) -> torch.Tensor:
        rows = torch.arange(x.shape[0], device=x.device)
        ends = counts.cumsum(0)
        expert = torch.bucketize(rows, ends, right=True).clamp(max=counts.numel() - 1)
        position = rows - (ends - counts)[expert]
        part = ((position + 1) * self.tp - 1) // counts[expert].clamp(min=1)
        mine = (part == self.tp_rank) & (rows < ends[-1])
        order = torch.argsort((~mine).to(torch.int8), stable=True)  # my rows first, still grouped by expert
        bounds = counts * torch.arange(self.tp + 1, device=counts.device).unsqueeze(1) // self.tp
        undo = inverse(order)
        out = self.inner(permute_rows(x, order, undo), bounds[self.tp_rank + 1] - bounds[self.tp_rank], experts)
        return permute_rows(out, undo, order)


def whole_expert_widths(model: nn.Module) -> None:
    """Undo tensor parallelism's split of the routed experts' hidden widths (their DTensors over tp become whole
    tensors: shapes only on the meta device), for expert parallelism over the tp ranks."""
    for _, layer in moe_layers(model):
        for name in ("w1", "w2", "w3"):
            weight = getattr(layer.experts, name).detach()
            if isinstance(weight, DTensor):
                whole = torch.empty(weight.shape, dtype=weight.dtype, device="meta") if weight.is_meta else None
                setattr(layer.experts, name, nn.Parameter(whole if whole is not None else weight.full_tensor()))


def apply_expert_parallel(model: nn.Module, ep: dist.ProcessGroup | DeviceMesh, chunks: int = 1) -> nn.Module:
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
        layer.dispatch = ExpertParallelDispatch(group, num_experts, chunks)
    return model


def local_part(weight: torch.Tensor) -> torch.Tensor:
    """This rank's experts of a stacked expert weight (differentiable; a plain tensor is already local)."""
    return weight.to_local() if isinstance(weight, DTensor) else weight


def shard_experts(model: nn.Module, ep_mesh: DeviceMesh, ep_tp_mesh: DeviceMesh | None = None, chunks: int = 1) -> int:
    """Make every MoE layer's w1/w2/w3 a DTensor sharded on the expert dimension over the 1-D `ep_mesh` and
    install the all-to-all dispatch (in `chunks` overlapped parts); returns the number of MoE layers.

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
        layer.dispatch = ExpertParallelDispatch(ep_mesh.get_group(), num_experts, chunks)
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
