"""The step body with parallel.pp > 1: each micro-batch through the pipeline schedule (forge.parallel.pipeline),
which splits it again into parallel.microbatches chunks; every pp rank reads the same batches.

The schedule's loss is plain cross-entropy on the last stage (validation refuses conf/loss options other than it,
and document masking, with pp): every token is labelled, so its mean of chunk means is the token mean.
"""

from collections.abc import Iterable

import torch

from forge.data import Batch
from forge.data.loader import batch_to_device
from forge.parallel.grads import clip_grad_norm, set_gradient_sync
from forge.parallel.pipeline import Pipeline
from forge.train.losses import IGNORE_INDEX
from forge.train.precision import autocast


class PipelineStep:
    """forward_backward and evaluate of this rank's pipeline stages; the losses are the last stage's, broadcast to
    every pp rank."""

    count_folded = False  # every token is labelled: the loss is a mean of chunk means, no count to wait for

    def __init__(self, pipeline: Pipeline, device: torch.device, dtype: str, defer_grad_sync: bool = False):
        self.pipeline = pipeline
        self.model = pipeline.model
        self.device = device
        self.dtype = dtype
        self.defer_grad_sync = defer_grad_sync

    def forward_backward(self, batches: list[Batch], loss=None) -> tuple[torch.Tensor, torch.Tensor]:
        """The schedule's forward and backward of each micro-batch; the stages train plain cross-entropy (the
        last stage's, built into the schedule), so `loss` is not used."""
        loss_sum, tokens = torch.zeros((), device=self.device), torch.zeros((), device=self.device)
        for micro, batch in enumerate(batches):
            if self.defer_grad_sync:
                set_gradient_sync(self.model, micro == len(batches) - 1)
            inputs, labels, _ = batch_to_device(batch, self.device)
            with autocast(self.device, self.dtype):
                loss_sum += self.pipeline.step(inputs, labels)  # the mean over the schedule's chunks
            tokens += (labels != IGNORE_INDEX).sum()
        self.pipeline.average_grads(len(batches))
        self.pipeline.sum_tied_grads()
        return self.pipeline.from_last_stage(loss_sum) / len(batches) * tokens, tokens

    def clip_grad_norm(self, max_norm: float) -> torch.Tensor:
        return clip_grad_norm(self.model, max_norm, self.pipeline.group, self.pipeline.counted_elsewhere)

    def finish_token_mean(self, world_tokens: torch.Tensor, norm: torch.Tensor, max_norm: float) -> torch.Tensor:
        raise NotImplementedError("a pipeline's gradients are token means already (count_folded is False)")

    @torch.no_grad()
    def evaluate(self, batches: Iterable[Batch]) -> tuple[torch.Tensor, torch.Tensor]:
        """Forward-only passes of the schedule, on every pp rank."""
        self.model.eval()
        total, tokens = torch.zeros((), device=self.device), torch.zeros((), device=self.device)
        for batch in batches:
            inputs, labels, _ = batch_to_device(batch, self.device)
            count = (labels != IGNORE_INDEX).sum()
            with autocast(self.device, self.dtype):
                total += self.pipeline.eval_loss(inputs, labels) * count
            tokens += count
        self.model.train()
        return self.pipeline.from_last_stage(total), tokens
