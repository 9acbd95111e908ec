"""The step body of a model held whole on this rank (one process, or any dp, tp or ep layout) on token batches
(inputs, labels[, doc_ids]): each micro-batch's forward and backward in turn. VLMStep adapts it to media batches."""

from collections.abc import Callable, Iterable

import torch
from torch import nn
from torch.distributed.device_mesh import DeviceMesh

from forge.data import Batch
from forge.data.loader import batch_to_device
from forge.model.moe import router_losses
from forge.parallel.grads import clip_grad_norm, set_gradient_sync
from forge.parallel.mesh import dp_rank_and_size, sum_over_dp
from forge.train.losses import IGNORE_INDEX, CrossEntropyLoss, Loss
from forge.train.precision import autocast

EVAL_LOSS = CrossEntropyLoss()
"""Validation is plain cross-entropy, whatever conf/loss trains with (a z-loss term is not part of it)."""


class TextStep:
    """forward_backward and evaluate of a model that the losses call as `model(inputs, attn_mask=...)`.

    `train_loss(batch)` is the training loss of one micro-batch, with autograd: the trainer's `batch_loss`, which
    runs conf/loss through this step's `batch_loss` (and lets resilience.inject_nan_at_step spoil one step's).
    `defer_grad_sync` reduces the gradients only after the last micro-batch (unsharded models; sharded ones reduce
    at every micro-batch, so that no unsharded gradient is held between them).
    """

    def __init__(
        self,
        model: nn.Module,
        device: torch.device,
        dtype: str,
        mesh: DeviceMesh | None = None,
        defer_grad_sync: bool = False,
        train_loss: Callable[[Batch], torch.Tensor] | None = None,
    ):
        self.model = model
        self.device = device
        self.dtype = dtype
        self.mesh = mesh
        self.dp_size = dp_rank_and_size(mesh)[1]
        self.defer_grad_sync = defer_grad_sync
        self.train_loss = train_loss

    def labels(self, batch: Batch) -> torch.Tensor:
        return batch[1]

    def batch_loss(self, batch: Batch, loss: Loss) -> torch.Tensor:
        """`loss` (a conf/loss) of one micro-batch, moved to this step's device, under its autocast."""
        inputs, labels, attn_mask = batch_to_device(batch, self.device)
        with autocast(self.device, self.dtype):
            return loss(self.model, inputs, labels, attn_mask)

    def labelled_tokens(self, batch: Batch) -> torch.Tensor:
        return (self.labels(batch) != IGNORE_INDEX).sum()

    def forward_backward(self, batches: list[Batch]) -> tuple[torch.Tensor, torch.Tensor]:
        """Each micro-batch's mean loss is weighted by its labelled tokens x dp ranks / the step's labelled tokens
        over all ranks (counted up front, one all-reduce), so that the gradients, which FSDP/DDP average over the
        ranks, are those of the token mean: ignored labels (document masking, VLM prompts) weigh nothing. The MoE
        aux and z losses are each a mean over a micro-batch's tokens, averaged over micro-batches and ranks."""
        assert self.train_loss is not None, "a TextStep built without train_loss only evaluates"
        counts = torch.stack([self.labelled_tokens(b) for b in batches]).to(self.device, torch.float32)
        weights = counts * self.dp_size / sum_over_dp(counts.sum(), self.mesh).clamp(min=1)
        loss_sum = torch.zeros((), device=self.device)
        for micro, batch in enumerate(batches):
            if self.defer_grad_sync:
                set_gradient_sync(self.model, micro == len(batches) - 1)
            loss = self.train_loss(batch)
            (loss * weights[micro] + router_losses(self.model) / len(batches)).backward()
            loss_sum += loss.detach() * counts[micro]
        return loss_sum, counts.sum()

    def clip_grad_norm(self, max_norm: float) -> torch.Tensor:
        return clip_grad_norm(self.model, max_norm)

    @torch.no_grad()
    def evaluate(self, batches: Iterable[Batch]) -> tuple[torch.Tensor, torch.Tensor]:
        was_training = self.model.training
        self.model.eval()
        total, tokens = torch.zeros((), device=self.device), torch.zeros((), device=self.device)
        for batch in batches:
            count = self.labelled_tokens(batch).to(self.device)
            total += self.batch_loss(batch, EVAL_LOSS) * count
            tokens += count
        self.model.train(was_training)
        return total, tokens


def evaluate(model: nn.Module, batches: Iterable[Batch], device: torch.device, dtype: str) -> float:
    """Mean loss over the labelled tokens of the given token batches, in this process (forge-eval)."""
    total, tokens = TextStep(model, device, dtype).evaluate(batches)
    return (total / tokens.clamp(min=1)).item()
