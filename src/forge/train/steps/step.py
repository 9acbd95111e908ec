"""What the loop asks of a step body, whichever model and layout it runs.

The trainer picks one body when it builds the model (TextStep, VLMStep or PipelineStep) and then, each optimizer
step, calls `forward_backward` on the step's micro-batches and `clip_grad_norm` (then `finish_token_mean` where
the body folds the token count); each evaluation calls `evaluate`.
Both return this rank's (sum of the token losses, labelled tokens): sums, so that `token_mean` adds up the dp
ranks' and divides once, and the loss is the mean over the global batch's labelled tokens.
"""

from collections.abc import Iterable
from typing import Protocol

import torch
from torch import nn
from torch.distributed.device_mesh import DeviceMesh

from forge.data import Batch
from forge.parallel.mesh import sum_over_token_ranks


class Step(Protocol):
    model: nn.Module
    """What the optimizer, the checkpoints and the metrics see: the model, or this rank's pipeline stages."""

    def forward_backward(self, batches: list[Batch], loss) -> tuple[torch.Tensor, torch.Tensor]:
        """Forward and backward of one optimizer step's micro-batches under the training `loss` (a conf/loss; a
        pipeline's stages train their own cross-entropy), the gradients left summed in the parameters
        as the token mean over every rank's micro-batches (with `count_folded`, as token sums that
        `finish_token_mean` divides); returns this rank's (loss sum, labelled tokens)."""
        ...

    count_folded: bool
    """forward_backward leaves the gradients as token sums: the loop sums the step's labelled tokens in the
    non-finite flags' all-reduce and hands them to `finish_token_mean` (TextStep's; no other body folds)."""

    def clip_grad_norm(self, max_norm: float) -> torch.Tensor:
        """Clip the gradients to a global norm of max_norm (<= 0: only measure it); returns the norm."""
        ...

    def finish_token_mean(self, world_tokens: torch.Tensor, norm: torch.Tensor, max_norm: float) -> torch.Tensor:
        """Only under `count_folded`: divide the gradients by the step's labelled tokens and clip them; returns the
        norm after the division."""
        ...

    def evaluate(self, batches: Iterable[Batch]) -> tuple[torch.Tensor, torch.Tensor]:
        """Plain cross-entropy of the batches, without gradients; returns this rank's (loss sum, labelled tokens)."""
        ...


def token_mean(loss_sum: torch.Tensor, tokens: torch.Tensor, mesh: DeviceMesh | None) -> torch.Tensor:
    """The mean token loss over every token rank (dp x cp), from each rank's (loss sum, labelled tokens): one
    all-reduce."""
    totals = sum_over_token_ranks(torch.stack([loss_sum, tokens.to(loss_sum)]), mesh)
    return totals[0] / totals[1].clamp(min=1)
