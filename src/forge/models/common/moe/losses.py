"""Router losses: the Switch-style load-balancing loss and the router z-loss."""

from collections.abc import Callable

import torch

from forge.models.common.moe.dispatch import count_per_expert


def load_balancing_loss(
    probs: torch.Tensor, experts: torch.Tensor, num_experts: int, counts: torch.Tensor | None = None
) -> torch.Tensor:
    """Switch Transformer's loss: E * sum_i f_i * P_i over the given tokens.

    probs (T, E) normalised router scores, experts (T, k) chosen ids. f_i is the fraction of the T * k assignments
    that chose expert i (no gradient), P_i the mean probability given to expert i. A perfectly even router scores
    1.0 whatever k is; a router sending everything to one expert scores up to E.
    `counts` (E,) replaces the assignments counted from `experts`, e.g. by those of every data-parallel rank: the
    global-batch loss, whose mean over ranks equals the loss of all their tokens in one process.
    """
    if counts is None:
        counts = count_per_expert(experts, num_experts)
    counts = counts.to(probs.dtype)
    fraction = counts / counts.sum().clamp(min=1)
    return num_experts * (fraction * probs.mean(dim=0)).sum()


def sequence_balancing_loss(
    probs: torch.Tensor,
    experts: torch.Tensor,
    num_experts: int,
    batch: int,
    sum_counts: Callable[[torch.Tensor], torch.Tensor] | None = None,
) -> torch.Tensor:
    """The same loss computed per sequence and averaged (DeepSeek-V3's complementary sequence-wise loss).

    probs (batch * seq, E) and experts (batch * seq, k) with the tokens of one sequence contiguous. `sum_counts`
    sums the (batch, E) per-sequence counts over the ranks holding the other parts of the sequences (their P
    stays each rank's own mean, which the ranks' average makes the whole sequence's).
    """
    seq_probs = probs.view(batch, -1, num_experts)
    seq_experts = experts.view(batch, -1, experts.shape[-1])
    one_hot = torch.zeros_like(seq_probs).scatter_add_(2, seq_experts, torch.ones_like(seq_experts, dtype=probs.dtype))
    counts = one_hot.sum(dim=1)
    counts = sum_counts(counts) if sum_counts is not None else counts
    fraction = counts / counts.sum(dim=-1, keepdim=True)
    return num_experts * (fraction * seq_probs.mean(dim=1)).sum(dim=-1).mean()


def router_z_loss(logits: torch.Tensor) -> torch.Tensor:
    """ST-MoE's z-loss: mean over tokens of logsumexp(logits)^2; keeps gate logits small."""
    return torch.logsumexp(logits.float(), dim=-1).square().mean()
