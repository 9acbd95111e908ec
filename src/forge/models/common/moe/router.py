"""Routers: pick top-k experts per token and the weights that combine their outputs.

Both routers score tokens with one bias-free linear gate (dim -> num_experts). They differ in how scores become
weights and how the load is balanced:

* softmax_topk (Mixtral): softmax over all experts, take the top-k, renormalise the k weights to sum to 1. The load
  is balanced by the Switch-style auxiliary loss. (With top_k=1 the weight is always 1, so the gate then learns
  only from the auxiliary and z losses.)
* sigmoid_topk (DeepSeek-V3): an independent sigmoid per expert. A per-expert bias is added to the scores for the
  choice of experts only (never to the weights, never through the gradient); the trainer nudges it after each step
  towards the under-loaded experts (`update_router_biases`). The k weights are the unbiased scores renormalised.

Either may limit a token to the experts of its best groups (DeepSeek-V3's n_group / topk_group: a group scores
the sum of its two best selection scores) and scale the renormalised weights (routed_scaling_factor).
"""

from dataclasses import dataclass

import torch
from torch import nn

from forge.models.common.init_spec import ZEROS, InitSpec, apply_specs, trunc_normal
from forge.models.common.moe.args import RouterKind


@dataclass
class Routing:
    """What a router decided for T tokens."""

    experts: torch.Tensor
    """(T, k) int64 expert ids, in decreasing order of selection score."""
    weights: torch.Tensor
    """(T, k) combine weights (renormalised over the k chosen experts)."""
    probs: torch.Tensor
    """(T, E) scores normalised over experts (each row sums to 1): the P of the load-balancing loss."""
    logits: torch.Tensor
    """(T, E) raw gate outputs, for the z-loss."""


class Router(nn.Module):
    """Linear gate plus top-k selection; `kind` is a RouterKind."""

    def __init__(
        self, dim: int, num_experts: int, top_k: int, kind: str, groups: int = 1, groups_kept: int = 1,
        scale: float = 1.0,
    ):  # fmt: skip
        super().__init__()
        if kind not in tuple(RouterKind):
            raise ValueError(f"router kind {kind!r} is not one of {', '.join(RouterKind)}")
        self.kind, self.top_k = kind, top_k
        self.groups, self.groups_kept, self.scale = groups, groups_kept, scale
        self.gate = nn.Linear(dim, num_experts, bias=False)
        # Selection-only bias of the sigmoid router: state (checkpointed), not a parameter (no gradient).
        self.register_buffer("expert_bias", torch.zeros(num_experts), persistent=kind == "sigmoid_topk")

    def forward(self, x: torch.Tensor) -> Routing:
        """x (T, dim) -> Routing. Scores are computed in fp32 whatever the autocast dtype."""
        logits = self.gate(x).float()
        if self.kind == "softmax_topk":
            scores = probs = logits.softmax(dim=-1)
            choice = scores
        else:
            scores = logits.sigmoid()
            choice = scores + self.expert_bias
            probs = scores / scores.sum(dim=-1, keepdim=True)
        _, experts = self.within_best_groups(choice).topk(self.top_k, dim=-1)
        top = scores.gather(-1, experts)
        weights = top / top.sum(dim=-1, keepdim=True) * self.scale
        return Routing(experts=experts, weights=weights, probs=probs, logits=logits)

    def within_best_groups(self, choice: torch.Tensor) -> torch.Tensor:
        """Group-limited routing: selection scores outside each token's `groups_kept` best groups set to -inf."""
        if self.groups_kept >= self.groups:
            return choice
        grouped = choice.view(choice.shape[0], self.groups, -1)
        best = grouped.topk(2, dim=-1).values.sum(dim=-1).topk(self.groups_kept, dim=-1).indices
        keep = torch.zeros_like(grouped[..., 0], dtype=torch.bool).scatter_(1, best, True)
        return grouped.masked_fill(~keep.unsqueeze(-1), float("-inf")).view_as(choice)

    def init_specs(self, std: float) -> dict[str, InitSpec]:
        return {"gate.weight": trunc_normal(std), "expert_bias": ZEROS}

    def init_weights(self, std: float) -> None:
        apply_specs(self, self.init_specs(std))
