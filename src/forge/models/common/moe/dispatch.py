"""Token assignments sorted by expert, with an optional capacity limit, and the default (all-local) dispatch.

Capacity rule (capacity_factor > 0): each expert accepts at most ceil(capacity_factor * T * k / E) of the T * k
assignments of a micro-batch. When more arrive, an expert keeps those with the highest routing weight; equal
weights keep the earlier token (lower flat index token * k + slot). The rule is deterministic and does not depend
on the order of the experts or of the ranks. A dropped assignment contributes nothing: the token keeps only its
other experts' outputs (and the residual). Under expert parallelism the limit applies on each source rank.
"""

import math
from collections.abc import Callable
from dataclasses import dataclass
from typing import Protocol

import torch


@dataclass
class Assignments:
    """Kept (token, expert) pairs in expert order."""

    tokens: torch.Tensor
    """(N,) index of the token of each kept assignment."""
    weights: torch.Tensor
    """(N,) its combine weight."""
    counts: torch.Tensor
    """(E,) int64 kept assignments per expert (N = counts.sum())."""
    routed: torch.Tensor
    """(E,) int64 assignments per expert before the capacity limit."""


def expert_capacity(num_tokens: int, top_k: int, num_experts: int, capacity_factor: float) -> int:
    """Most assignments one expert accepts; 0 capacity_factor means no limit."""
    if capacity_factor <= 0:
        return num_tokens * top_k
    return math.ceil(capacity_factor * num_tokens * top_k / num_experts)


def assign(experts: torch.Tensor, weights: torch.Tensor, num_experts: int, capacity_factor: float) -> Assignments:
    """experts, weights (T, k) -> kept assignments grouped by expert (see the module docstring for drops)."""
    num_tokens, top_k = experts.shape
    flat_experts, flat_weights = experts.flatten(), weights.flatten()
    routed = torch.bincount(flat_experts, minlength=num_experts)
    if capacity_factor <= 0:
        order = torch.argsort(flat_experts, stable=True)
        counts = routed
    else:
        # Within an expert: highest weight first, ties in flat order; then keep the first `capacity` rows.
        by_weight = torch.argsort(flat_weights.detach(), descending=True, stable=True)
        order = by_weight[torch.argsort(flat_experts[by_weight], stable=True)]
        starts = routed.cumsum(0) - routed
        sorted_experts = flat_experts[order]
        position = torch.arange(order.numel(), device=order.device) - starts[sorted_experts]
        capacity = expert_capacity(num_tokens, top_k, num_experts, capacity_factor)
        order = order[position < capacity]
        counts = routed.clamp(max=capacity)
    return Assignments(tokens=order // top_k, weights=flat_weights[order], counts=counts, routed=routed)


class ExpertCompute(Protocol):
    def __call__(self, x: torch.Tensor, counts: torch.Tensor) -> torch.Tensor: ...


Dispatch = Callable[[torch.Tensor, torch.Tensor, ExpertCompute], torch.Tensor]
"""(x grouped by global expert, counts per global expert, local experts) -> expert outputs in the same order."""


def local_dispatch(x: torch.Tensor, counts: torch.Tensor, experts: ExpertCompute) -> torch.Tensor:
    """All experts live in this process: run them directly."""
    return experts(x, counts)
