"""The MoE layer that replaces a block's dense MLP: router, routed experts, optional shared experts."""

import contextlib
from collections.abc import Callable

import torch
from torch import nn

from forge.models.common.feed_forward import FeedForward
from forge.models.common.init_spec import InitSpec, prefixed
from forge.models.common.moe.args import AuxLossScope, MoEArgs
from forge.models.common.moe.dispatch import Dispatch, assign, local_dispatch, permute_rows
from forge.models.common.moe.experts import GroupedExperts, compute_dtype
from forge.models.common.moe.losses import load_balancing_loss, router_z_loss, sequence_balancing_loss
from forge.models.common.moe.router import Router

LoadReduce = Callable[[torch.Tensor], torch.Tensor]
"""Sums a per-expert count tensor over the data-parallel ranks (installed by forge.parallel for global_batch)."""


def without_autocast(device_type: str) -> contextlib.AbstractContextManager:
    """Autocast off for the device's ops inside (nothing to turn off where it has no autocast, e.g. meta)."""
    if torch.amp.is_autocast_available(device_type):
        return torch.autocast(device_type, enabled=False)
    return contextlib.nullcontext()


class MoE(nn.Module):
    """x -> sum over the k chosen experts of weight * expert(x) [+ shared experts(x)].

    Each forward keeps its router losses (`last_aux_loss`, `last_z_loss`, with gradient) and its expert loads, so
    the trainer reads them through `forge.models.common.moe.balance` without the block's signature changing.
    `dispatch` moves grouped tokens to the experts and back; expert parallelism replaces it from outside.
    `sum_load` (None in one process) sums the expert counts over the data-parallel ranks for the global-batch
    aux loss; the data-parallel plan installs it. `sum_sequence_counts` (None unless context parallelism splits
    each sequence over ranks) sums the micro-batch and sequence losses' counts over the ranks holding the other
    parts of the same sequences, so each rank's loss, averaged over them as the gradients are, is one process's.
    Evaluation (`eval()`) always uses the local counts.
    """

    def __init__(self, dim: int, hidden: int, args: MoEArgs):
        super().__init__()
        if args.aux_loss_scope not in tuple(AuxLossScope):
            raise ValueError(f"moe.aux_loss_scope={args.aux_loss_scope!r} is not one of {', '.join(AuxLossScope)}")
        self.args = args
        self.router = Router(
            dim, args.num_experts, args.top_k, args.router, args.expert_groups, args.groups_per_token, args.route_scale,
            args.balanced_selection,
        )  # fmt: skip
        self.experts = GroupedExperts(dim, hidden, args.num_experts, args.grouped_mm)
        # n shared SwiGLU experts of size `hidden` equal one SwiGLU of size n * hidden.
        self.shared_experts = FeedForward(dim, hidden * args.num_shared_experts) if args.num_shared_experts else None
        self.dispatch: Dispatch = local_dispatch
        self.sum_load: LoadReduce | None = None
        self.sum_sequence_counts: LoadReduce | None = None
        self.last_aux_loss: torch.Tensor | None = None
        self.last_z_loss: torch.Tensor | None = None
        self.last_routed: torch.Tensor | None = None
        self.last_kept: torch.Tensor | None = None
        self.last_offsets: torch.Tensor | None = None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        shape = x.shape
        tokens = x.reshape(-1, shape[-1])
        routing = self.router(tokens)
        args = self.args
        kept = assign(routing.experts, routing.weights, args.num_experts, args.capacity_factor)
        # One permutation of the k copies of each token to expert order (cast first: k times fewer rows to cast; the
        # backward sums a token's k gradients in one reduction) and one back.
        copies = tokens.to(compute_dtype(tokens)).unsqueeze(1).expand(-1, args.top_k, -1).flatten(0, 1)
        expert_out = self.dispatch(permute_rows(copies, kept.order, kept.slots), kept.counts, self.experts)
        per_slot = permute_rows(expert_out, kept.slots, kept.order).float().view(-1, args.top_k, shape[-1])
        weights = kept.weights.index_select(0, kept.slots).float().view(-1, 1, args.top_k)  # 0 where dropped
        with without_autocast(x.device.type):  # autocast would run the product in bf16
            out = torch.bmm(weights, per_slot).view(-1, shape[-1]).to(x.dtype)  # each token's weighted sum, in fp32
        if self.shared_experts is not None:
            out = out + self.shared_experts(tokens)

        spread = self.sum_sequence_counts if self.training else None
        if args.aux_loss_scope == "sequence" and len(shape) == 3:
            aux = sequence_balancing_loss(routing.probs, routing.experts, args.num_experts, shape[0], spread)
        elif args.aux_loss_scope == "global_batch" and self.training and self.sum_load is not None:
            counts = self.sum_load(kept.routed)
            aux = load_balancing_loss(routing.probs, routing.experts, args.num_experts, counts)
        else:
            counts = kept.routed  # every assignment, before any capacity limit
            counts = spread(counts) if spread is not None else counts
            aux = load_balancing_loss(routing.probs, routing.experts, args.num_experts, counts)
        self.last_aux_loss = aux
        self.last_z_loss = router_z_loss(routing.logits)
        self.last_routed, self.last_kept = kept.routed.detach(), kept.counts.detach()
        self.last_offsets = routing.offsets
        return out.view(shape)

    def init_specs(self, std: float, out_std: float) -> dict[str, InitSpec]:
        specs = prefixed("router", self.router.init_specs(std)) | prefixed(
            "experts", self.experts.init_specs(std, out_std)
        )
        if self.shared_experts is not None:
            specs |= prefixed("shared_experts", self.shared_experts.init_specs(std, out_std))
        return specs

    def init_weights(self, std: float, out_std: float) -> None:
        self.router.init_weights(std)
        self.experts.init_weights(std, out_std)
        if self.shared_experts is not None:
            self.shared_experts.init_weights(std, out_std)
