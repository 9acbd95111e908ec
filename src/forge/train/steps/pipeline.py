"""The step body with parallel.pp > 1: each micro-batch through the pipeline schedule (forge.parallel.pipeline),
which splits it again into parallel.microbatches chunks; every pp rank reads the same batches.

The schedule's loss is plain cross-entropy on the last stage (validation refuses conf/loss options other than it
with pp), summed over each chunk's labelled tokens and weighted by the step's count over the token ranks
(forge.parallel.pipeline.ChunkLoss): the gradients are those of the step's token mean, as one process's.
"""

from collections.abc import Iterable

import torch
from torch.distributed.device_mesh import DeviceMesh

from forge.data import Batch
from forge.data.loader import batch_to_device
from forge.models.common.attention import DocumentMask
from forge.parallel.context_parallel import ContextSplit
from forge.parallel.grads import clip_grad_norm, set_gradient_sync
from forge.parallel.mesh import start_sum_over_token_ranks, token_ranks
from forge.parallel.pipeline import Pipeline
from forge.train.losses import IGNORE_INDEX
from forge.train.precision import autocast


class PipelineStep:
    """forward_backward and evaluate of this rank's pipeline stages; the losses are the last stage's, broadcast to
    every pp rank."""

    count_folded = False  # the step's token count is summed up front: it weighs the chunks' losses

    def __init__(
        self,
        pipeline: Pipeline,
        device: torch.device,
        dtype: str,
        defer_grad_sync: bool = False,
        mesh: DeviceMesh | None = None,
        context: ContextSplit | None = None,
    ):
        self.pipeline = pipeline
        self.model = pipeline.model
        self.device = device
        self.dtype = dtype
        self.defer_grad_sync = defer_grad_sync
        self.mesh = mesh
        self.context = context  # context parallelism: each rank's part of every sequence

    def forward_backward(self, batches: list[Batch], loss=None) -> tuple[torch.Tensor, torch.Tensor]:
        """The schedule's forward and backward of each micro-batch; the stages train plain cross-entropy (the
        last stage's, built into the schedule), so `loss` is not used. Each chunk's token sum is weighted by
        token ranks / the step's labelled tokens over them (one scalar all-reduce, no host sync)."""
        counts = torch.stack([(self.labels(batch) != IGNORE_INDEX).sum() for batch in batches]).to(self.device).float()
        total, pending = start_sum_over_token_ranks(counts.sum(), self.mesh)
        if pending is not None:
            pending.wait()
        weight = token_ranks(self.mesh) / total.clamp(min=1)
        loss_sum = torch.zeros((), device=self.device)
        for micro, batch in enumerate(batches):
            if self.defer_grad_sync:
                set_gradient_sync(self.model, micro == len(batches) - 1)
            inputs, labels, mask = self.to_device(batch)
            with autocast(self.device, self.dtype):
                loss_sum += self.pipeline.step(inputs, labels, weight, mask, len(batches))
        self.pipeline.sum_tied_grads()
        return self.pipeline.from_last_stage(loss_sum), counts.sum()

    def labels(self, batch: Batch) -> torch.Tensor:
        return batch[1] if self.context is None else self.context.labels(batch[1])

    def to_device(self, batch: Batch) -> tuple[torch.Tensor, torch.Tensor, DocumentMask | None]:
        """(inputs, labels, mask) on the device: this rank's positions of them under context parallelism."""
        inputs, labels, mask = batch_to_device(batch, self.device)
        return (inputs, labels, mask) if self.context is None else self.context.shard(inputs, labels, mask)

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
            inputs, labels, mask = self.to_device(batch)
            with autocast(self.device, self.dtype):
                total += self.pipeline.eval_loss(inputs, labels, mask)
            tokens += (labels != IGNORE_INDEX).sum()
        self.model.train()
        return self.pipeline.from_last_stage(total), tokens
