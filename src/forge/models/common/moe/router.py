"""Routers: pick top-k experts per token and the weights that combine their outputs.

Both routers score tokens with one bias-free linear gate (dim -> num_experts). They differ in how scores become
weights and how the load is balanced:

* softmax_topk (Mixtral): softmax over all experts, take the top-k, renormalise the k weights to sum to 1. The load
  is balanced by the Switch-style auxiliary loss. (With top_k=1 the weight is always 1, so the gate then learns
  only from the auxiliary and z losses.)
* sigmoid_topk (DeepSeek-V3): an independent sigmoid per expert. A per-expert bias is added to the scores for the
  choice of experts only (never to the weights, never through the gradient); the trainer nudges it after each step
  towards the under-loaded experts (`update_router_biases`). The k weights are the unbiased scores renormalised.

With balanced selection (MoEArgs.balanced_selection), a training forward adds per-expert offsets, solved on the
tokens at hand, to the selection scores so that each expert gets its even share of them (`balancing_offsets`); the
weights stay the unbiased scores. This is the bias rule solved within the batch rather than taken one sign step per
optimizer step: early in a fast run the hidden states are nearly alike and the gate learns a shared preference for
a few experts faster than sign steps of a fixed size follow it. The offsets depend only on the routed tokens, with
no gradient, and are the same when activation checkpointing recomputes the forward.

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
    offsets: torch.Tensor | None = None
    """(E,) the selection offsets of balanced selection (training forwards only), else None."""


class Router(nn.Module):
    """Linear gate plus top-k selection; `kind` is a RouterKind."""

    def __init__(
        self, dim: int, num_experts: int, top_k: int, kind: str, groups: int = 1, groups_kept: int = 1,
        scale: float = 1.0, balanced: bool = False,
    ):  # fmt: skip
        super().__init__()
        if kind not in tuple(RouterKind):
            raise ValueError(f"router kind {kind!r} is not one of {', '.join(RouterKind)}")
        self.kind, self.top_k, self.balanced = kind, top_k, balanced
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
        offsets = None
        if self.balanced and self.training:
            offsets = balancing_offsets(choice, self.top_k)
            choice = choice + offsets
        _, experts = self.within_best_groups(choice).topk(self.top_k, dim=-1)
        top = scores.gather(-1, experts)
        weights = top / top.sum(dim=-1, keepdim=True) * self.scale
        return Routing(experts=experts, weights=weights, probs=probs, logits=logits, offsets=offsets)

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


BALANCING_ROUNDS = 8
"""Rounds of `balancing_offsets`. Measured on the scaled-down deepseek_v3_small (benchmarks/moe/balance.py), 4
rounds of half steps let a layer's busiest expert reach 5x its share and starve others; 8 rounds of 0.8 held
every layer within 2x. On 512 tokens that share one preference, 8 rounds leave each expert within 5 % of its
share (tests/model/test_moe_balance.py)."""
BALANCING_STEP = 0.8
"""Fraction of each expert's own correction taken per round: the experts move together, so a full step overshoots."""


@torch.no_grad()
def balancing_offsets(choice: torch.Tensor, k: int, rounds: int = BALANCING_ROUNDS) -> torch.Tensor:
    """(E,) offsets that, added to `choice` (T, E), make top-k give each expert about T * k / E tokens.

    Each round takes, for every expert, the offset that alone would give it its share with the others fixed: a
    token picks expert e when e's score beats the token's k-th best among the others, so the share is set by the
    (T * k / E)-th largest margin of e's score over that threshold. The experts move together, hence a damped step
    and a few rounds. Scores of -inf stay out of reach, and an expert that fewer tokens can reach than its share
    takes the largest step up. Group-limited routing is not balanced by this (validation refuses the pair): all
    tokens sharing one preference keep the same groups, whatever the offsets.
    """
    tokens, experts = choice.shape
    offsets = torch.zeros(experts, dtype=choice.dtype, device=choice.device)
    if tokens == 0 or k >= experts:
        return offsets
    share = min(tokens, max(1, round(tokens * k / experts)))
    for _ in range(rounds):
        shifted = choice + offsets
        best = shifted.topk(k + 1, dim=-1).values
        kth, next_kth = best[:, k - 1 : k], best[:, -1:]
        margin = shifted - torch.where(shifted >= kth, next_kth, kth)
        needed = margin.kthvalue(tokens - share + 1, dim=0).values
        offsets -= BALANCING_STEP * torch.nan_to_num(needed.clamp(-1.0, 1.0), nan=0.0)
    return offsets - offsets.mean()  # a shift shared by all experts changes no choice; the bias stays centred
