"""The step body of a model held whole on this rank (one process, or any dp, tp or ep layout) on token batches
(inputs, labels[, doc_ids]): each micro-batch's forward and backward in turn. VLMStep adapts it to media batches."""

from collections.abc import Iterable

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import DeviceMesh

from forge.data import Batch
from forge.data.loader import batch_to_device, to_device
from forge.models.common.moe import has_router_losses, router_losses
from forge.parallel.context_parallel import ContextSplit
from forge.parallel.grads import clip_grad_norm, scale_grads, set_gradient_sync
from forge.parallel.mesh import start_sum_over_token_ranks, token_ranks
from forge.train.compute_weights import ComputeWeights, scope
from forge.train.losses import IGNORE_INDEX, CrossEntropyLoss, Loss, loss_context
from forge.train.precision import autocast, held_weight_casts

EVAL_LOSS = CrossEntropyLoss()
"""Validation is plain cross-entropy, whatever conf/loss trains with (a z-loss term is not part of it)."""


class TextStep:
    """forward_backward and evaluate of a model that the losses call as `model(inputs, attn_mask=...)`.

    `forward_backward` takes the step's training loss (conf/loss, called as loss(model, inputs, labels,
    attn_mask)) and runs it on each micro-batch through `batch_loss`.
    `defer_grad_sync` reduces the gradients only after the last micro-batch (unsharded models; sharded ones reduce
    at every micro-batch, so that no unsharded gradient is held between them). With `context` (context
    parallelism) each micro-batch's forward, loss and token count cover this rank's part of every sequence.
    `hold_weight_casts` casts each fp32 weight to bf16 once per step, not per micro-batch (see
    forge.train.precision.holds_weight_casts for when the trainer asks for it). `compute_weights` (a model with
    plain parameters computing in bf16, forge.train.compute_weights) puts one bf16 copy of the weights in the
    parameters for each step's micro-batches and each evaluation.
    """

    def __init__(
        self,
        model: nn.Module,
        device: torch.device,
        dtype: str,
        mesh: DeviceMesh | None = None,
        defer_grad_sync: bool = False,
        context: ContextSplit | None = None,
        hold_weight_casts: bool = False,
        compute_weights: ComputeWeights | None = None,
    ):
        self.model = model
        self.device = device
        self.dtype = dtype
        self.mesh = mesh
        self.token_ranks = token_ranks(mesh)
        self.defer_grad_sync = defer_grad_sync
        self.context = context
        self.hold_weight_casts = hold_weight_casts and compute_weights is None
        self.compute_weights = compute_weights
        # tensor parallelism leaves the logits split over the vocabulary: each loss runs under loss_parallel
        self.logits_split = mesh is not None and "tp" in (mesh.mesh_dim_names or ())
        # without router losses the step's token count can wait for the non-finite flags' all-reduce: the backward
        # leaves token sums and finish_token_mean divides them (a router loss's weight needs the count up front)
        self.count_folded = self.token_ranks > 1 and not has_router_losses(model)

    def labels(self, batch: Batch) -> torch.Tensor:
        return batch[1] if self.context is None else self.context.labels(batch[1])

    def batch_loss(self, batch: Batch, loss: Loss) -> torch.Tensor:
        """`loss` (a conf/loss) of one micro-batch, moved to this step's device, under its autocast."""
        inputs, labels, attn_mask = batch_to_device(batch, self.device)
        if self.context is not None:
            inputs, labels, attn_mask = self.context.shard(inputs, labels, attn_mask)
        with autocast(self.device, self.dtype):
            return loss(self.model, inputs, labels, attn_mask)

    def labelled_tokens(self, batch: Batch) -> torch.Tensor:
        return (self.labels(batch) != IGNORE_INDEX).sum()

    def forward_backward(self, batches: list[Batch], loss: Loss) -> tuple[torch.Tensor, torch.Tensor]:
        """`loss` of each micro-batch, then its backward. Each micro-batch's mean loss is weighted by its labelled
        tokens x token ranks (dp x cp) / the step's labelled tokens over them, so that the gradients, which
        FSDP/DDP average over those ranks, are those of the token mean: ignored labels (document masking, VLM
        prompts) weigh nothing. The MoE aux and z losses are each
        a mean over a micro-batch's tokens, averaged over micro-batches and ranks.

        The division by the step's count: with `count_folded` it is left to `finish_token_mean`, after the
        non-finite flags' all-reduce has summed the count; else the count is all-reduced here, overlapping the
        first micro-batch's forward."""
        counts = to_device(torch.stack([self.labelled_tokens(b) for b in batches]), self.device).float()
        total, pending = None, None
        if not self.count_folded:
            total, pending = start_sum_over_token_ranks(counts.sum(), self.mesh)
        loss_sum = torch.zeros((), device=self.device)
        with self.weights_scope():
            for micro, batch in enumerate(batches):
                if self.defer_grad_sync:
                    set_gradient_sync(self.model, micro == len(batches) - 1)
                with loss_context(self.logits_split):
                    value = self.batch_loss(batch, loss)
                    if pending is not None:
                        pending.wait()
                        pending = None
                    weight = counts[micro] * self.token_ranks
                    if total is not None:
                        weight = weight / total.clamp(min=1)
                    (value * weight + router_losses(self.model) / len(batches)).backward()
                loss_sum += value.detach() * counts[micro]
        return loss_sum, counts.sum()

    def weights_scope(self):
        """The scope of one step's micro-batches: the bf16 compute weights, or autocast's held casts, or none."""
        if self.compute_weights is not None:
            return self.compute_weights
        return held_weight_casts(self.device, self.hold_weight_casts)

    def clip_grad_norm(self, max_norm: float) -> torch.Tensor:
        return clip_grad_norm(self.model, max_norm)

    def finish_token_mean(self, world_tokens: torch.Tensor, norm: torch.Tensor, max_norm: float) -> torch.Tensor:
        """Under `count_folded`: divide the gradients by the step's labelled tokens over the token ranks and clip
        them to max_norm, in one pass; `world_tokens` is every rank's count summed (tensor-parallel peers each
        add theirs) and `norm` the gradients' norm before the division. Returns the norm after it."""
        peers = dist.get_world_size() // self.token_ranks  # ranks holding the same tokens
        tokens = torch.div(world_tokens, peers, rounding_mode="floor").clamp(min=1)
        factor = (1.0 / tokens.to(torch.float64)).to(norm.dtype)  # on the device: no host sync
        norm = norm * factor
        coef = factor
        if max_norm > 0:  # as torch's clip_grads_with_norm_
            coef = coef * (max_norm / (norm + 1e-6)).clamp(max=1.0)
        scale_grads(self.model, coef)
        return norm

    @torch.no_grad()
    def evaluate(self, batches: Iterable[Batch]) -> tuple[torch.Tensor, torch.Tensor]:
        was_training = self.model.training
        self.model.eval()
        total, tokens = torch.zeros((), device=self.device), torch.zeros((), device=self.device)
        with scope(self.compute_weights):
            for batch in batches:
                count = to_device(self.labelled_tokens(batch), self.device)
                with loss_context(self.logits_split):
                    total += self.batch_loss(batch, EVAL_LOSS) * count
                tokens += count
        self.model.train(was_training)
        return total, tokens


def evaluate(model: nn.Module, batches: Iterable[Batch], device: torch.device, dtype: str) -> float:
    """Mean loss over the labelled tokens of the given token batches, in this process (forge-eval)."""
    total, tokens = TextStep(model, device, dtype).evaluate(batches)
    return (total / tokens.clamp(min=1)).item()
