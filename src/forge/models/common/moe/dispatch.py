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
    """All T * k (token, expert) pairs: the N kept ones first, in expert order, then the dropped ones."""

    weights: torch.Tensor
    """(T * k,) its combine weight (0 for a dropped assignment)."""
    counts: torch.Tensor
    """(E,) int64 kept assignments per expert (N = counts.sum())."""
    routed: torch.Tensor
    """(E,) int64 assignments per expert before the capacity limit."""
    order: torch.Tensor
    """(T * k,) the flat index token * k + slot of each row: the permutation to expert order."""
    slots: torch.Tensor
    """(T * k,) the row of each (token, slot) pair, in flat order: the permutation back (order's inverse)."""
    top_k: int

    @property
    def tokens(self) -> torch.Tensor:
        """(T * k,) index of the token of each assignment."""
        return self.order // self.top_k


def count_per_expert(experts: torch.Tensor, num_experts: int) -> torch.Tensor:
    """(E,) int64 number of entries of `experts` naming each expert. A scatter, not bincount, which on CUDA reads
    the largest id on the host first."""
    flat = experts.flatten()
    return torch.zeros(num_experts, dtype=torch.int64, device=flat.device).scatter_add_(0, flat, torch.ones_like(flat))


def expert_capacity(num_tokens: int, top_k: int, num_experts: int, capacity_factor: float) -> int:
    """Most assignments one expert accepts; 0 capacity_factor means no limit."""
    if capacity_factor <= 0:
        return num_tokens * top_k
    return math.ceil(capacity_factor * num_tokens * top_k / num_experts)


def assign(experts: torch.Tensor, weights: torch.Tensor, num_experts: int, capacity_factor: float) -> Assignments:
    """experts, weights (T, k) -> assignments grouped by expert, kept before dropped (see the module docstring)."""
    num_tokens, top_k = experts.shape
    flat_experts, flat_weights = experts.flatten(), weights.flatten()
    routed = count_per_expert(flat_experts, num_experts)
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
        # The kept rows keep their expert order; the dropped ones move behind them (a stable sort on one bit).
        dropped_last = torch.argsort((position >= capacity).to(torch.uint8), stable=True)
        order = order[dropped_last]
        counts = routed.clamp(max=capacity)
        kept = torch.arange(order.numel(), device=order.device) < counts.sum()
        return Assignments(flat_weights[order] * kept, counts, routed, order, inverse(order), top_k)
    return Assignments(flat_weights[order], counts, routed, order, inverse(order), top_k)


class _PermuteRows(torch.autograd.Function):
    """x[order] whose backward is the gather grad[inverse], not index_select's scatter-add (order is a permutation)."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, order: torch.Tensor, inverse: torch.Tensor) -> torch.Tensor:
        ctx.save_for_backward(inverse)
        return x.index_select(0, order)

    @staticmethod
    def backward(ctx, grad: torch.Tensor) -> tuple[torch.Tensor, None, None]:
        (inverse,) = ctx.saved_tensors
        return grad.index_select(0, inverse), None, None


def permute_rows(x: torch.Tensor, order: torch.Tensor, inverse: torch.Tensor) -> torch.Tensor:
    """The rows of x in `order`, `inverse` being its inverse permutation."""
    return _PermuteRows.apply(x, order, inverse)


def inverse(order: torch.Tensor) -> torch.Tensor:
    """The permutation that undoes `order` (a scatter: no sort)."""
    rows = torch.arange(order.numel(), device=order.device)
    return torch.empty_like(order).scatter_(0, order, rows)


class ExpertCompute(Protocol):
    def __call__(self, x: torch.Tensor, counts: torch.Tensor) -> torch.Tensor: ...


Dispatch = Callable[[torch.Tensor, torch.Tensor, ExpertCompute], torch.Tensor]
"""(x grouped by global expert, kept counts per global expert, local experts) -> expert outputs in the same order.

x may hold more rows than counts.sum(): the dropped assignments, whose outputs the layer weighs by 0."""


def local_dispatch(x: torch.Tensor, counts: torch.Tensor, experts: ExpertCompute) -> torch.Tensor:
    """All experts live in this process: run them directly."""
    return experts(x, counts)
