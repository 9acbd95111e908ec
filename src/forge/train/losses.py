"""Training losses (conf/loss): token cross-entropy, plain or chunked, each with an optional PaLM z-loss.

A loss is called as `loss(model, inputs, labels, attn_mask)` inside the step's autocast and returns the scalar to
backpropagate; `model(inputs, attn_mask=..., head=...)` is forge's Transformer, or a VLM through the VLM step's
MediaModel, so every loss trains every model. Labels of -100 are ignored; every mean is over the labelled tokens.

Under tensor parallelism the head leaves the logits split over the vocabulary (a DTensor): cross-entropy and the
z-loss's logsumexp then combine each shard's softmax statistics (one number per token per all-reduce) under
torch's `loss_parallel`, which the step opens around the loss's forward and backward (`loss_context`), and return
plain tensors. No rank holds or gathers the whole logits.

z-loss (PaLM, Chowdhery et al. 2022): z_loss_weight * mean(logsumexp(logits)^2) keeps the softmax normaliser
near 1 (log Z near 0), which stabilises bf16 training of large vocabularies.

Chunked cross-entropy never holds the (tokens x vocab) logits at once: the model returns its final hidden
states, and the output projection, softmax and gradients are computed chunk by chunk of tokens. The gradients
with respect to the hidden states and the head's weight are computed during the forward pass (the backward
only scales them), so the head costs the same matmuls as the plain path while the peak memory of the head
drops from several (tokens x vocab) fp32 tensors to two of (chunk x vocab).
"""

import contextlib
import functools
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Protocol

import torch
import torch.nn.functional as F
from torch import nn
from torch.distributed.tensor import DTensor, Replicate
from torch.distributed.tensor.parallel import loss_parallel

from forge.train.loss_options import ChunkedCrossEntropyOptions, CrossEntropyOptions

IGNORE_INDEX = -100


class Loss(Protocol):
    def __call__(
        self,
        model: Callable[..., torch.Tensor],
        inputs: torch.Tensor | dict[str, torch.Tensor],
        labels: torch.Tensor,
        attn_mask: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """The mean loss of one micro-batch over its labelled tokens (with autograd where grad is enabled)."""
        ...


def vocab_parallel(logits: torch.Tensor) -> bool:
    """The logits are split over the vocabulary (tensor parallelism's head): a DTensor sharded on its last dim."""
    return isinstance(logits, DTensor) and any(p.is_shard(logits.dim() - 1) for p in logits.placements)


def loss_context(logits_split: bool) -> contextlib.AbstractContextManager:
    """What the forward and the backward of a loss over vocabulary-split logits run under: torch's `loss_parallel`
    (cross-entropy from the shards' softmax statistics, without gathering the logits); else nothing."""
    return _loss_parallel() if logits_split else contextlib.nullcontext()


@contextlib.contextmanager
def _loss_parallel() -> Iterator[None]:
    """torch's `loss_parallel`, whose custom ops are switched off again when the body raises (torch's own context
    leaves them on then)."""
    context = loss_parallel()
    context.__enter__()
    try:
        yield
    finally:
        context.__exit__(None, None, None)


def cross_entropy(logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    """Mean token cross-entropy in fp32 (labels of -100 are ignored). Vocabulary-split logits need
    `loss_context(True)` around the forward and the backward; the result is then a plain tensor too."""
    if not isinstance(logits, DTensor):
        return rowwise_cross_entropy(logits, labels)
    loss = _token_cross_entropy(logits, labels)
    return loss.full_tensor() if isinstance(loss, DTensor) else loss


# fp32 working set of one chunk of rows: on a CPU small enough to stay in cache and in malloc's heap (a fresh
# mapping costs a page fault per 4 KiB); elsewhere large enough that the loop costs few kernel launches
CPU_CHUNK_BYTES = 4 << 20
ACCELERATOR_CHUNK_BYTES = 256 << 20


def rowwise_cross_entropy(logits: torch.Tensor, labels: torch.Tensor, z_loss_weight: float = 0.0) -> torch.Tensor:
    """Mean over the labelled tokens of -log softmax(logits)[label] + z_loss_weight * logsumexp(logits)^2, in fp32,
    for plain (not vocabulary-split) logits of any float dtype, a chunk of rows at a time.

    Where eager F.cross_entropy of `logits.float()` writes an fp32 copy of the logits, their fp32 log-softmax, a
    zero-filled gradient and its backward, each as large as the logits, this touches one chunk of rows in fp32 at
    a time, and computes the logits' gradient in the forward, while the chunk is in cache (the backward only scales
    it): one exp per logit (benchmarks/train/rowwise_ce.py times it against torch's).
    The gradient takes the logits' place: the logits themselves are not saved."""
    logits, labels = logits.flatten(0, -2), labels.flatten()
    if torch.is_grad_enabled() and logits.requires_grad:
        return _RowwiseCrossEntropy.apply(logits, labels, z_loss_weight)
    return _rowwise_loss(logits, labels, z_loss_weight, None)


def _rowwise_loss(
    logits: torch.Tensor, labels: torch.Tensor, z_loss_weight: float, grad: torch.Tensor | None
) -> torch.Tensor:
    """The loss; when `grad` (shaped as the logits) is given, also fills in the loss's gradient."""
    valid = labels != IGNORE_INDEX
    scale = (valid / valid.sum().clamp(min=1))[:, None]  # each row's weight in the mean
    targets = labels.clamp(min=0)[:, None]
    lse = torch.empty_like(scale)
    chunk_bytes = CPU_CHUNK_BYTES if logits.device.type == "cpu" else ACCELERATOR_CHUNK_BYTES
    rows = max(1, chunk_bytes // (4 * logits.shape[1]))
    for start in range(0, logits.shape[0], rows):
        end = start + rows
        probs = logits[start:end].to(torch.float32, copy=True)
        top = probs.amax(dim=1, keepdim=True)
        total = probs.sub_(top).exp_().sum(dim=1, keepdim=True)
        torch.add(top, total.log(), out=lse[start:end])
        if grad is None:
            continue
        # d/dlogits of lse - logit[y] + w lse^2 = softmax (1 + 2 w lse) - onehot(y), each row times its weight
        row = scale[start:end]
        factor = row / total
        if z_loss_weight:
            factor = factor * (1 + 2 * z_loss_weight * lse[start:end])
        probs.mul_(factor).scatter_add_(1, targets[start:end], -row)
        grad[start:end].copy_(probs)
    per_token = lse - logits.gather(1, targets).float()
    if z_loss_weight:
        per_token = per_token + z_loss_weight * lse.square()
    # an ignored row weighs nothing even when its logits are not finite (0 x inf would be nan), as in torch's loss
    return torch.where(valid[:, None], per_token * scale, 0.0).sum()


class _RowwiseCrossEntropy(torch.autograd.Function):
    """rowwise_cross_entropy whose gradient is computed in the forward pass. The backward scales that gradient in
    place, so a second backward through the same graph (retain_graph) is refused by autograd's saved-tensor check."""

    @staticmethod
    def forward(ctx, logits, labels, z_loss_weight):
        grad = torch.empty_like(logits)
        loss = _rowwise_loss(logits, labels, z_loss_weight, grad)
        ctx.save_for_backward(grad)
        return loss

    @staticmethod
    def backward(ctx, grad_loss):
        (grad,) = ctx.saved_tensors
        return grad.mul_(grad_loss), None, None


def _token_cross_entropy(logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    return F.cross_entropy(logits.float().flatten(0, 1), labels.flatten(), ignore_index=IGNORE_INDEX)


@functools.cache
def compiled_cross_entropy() -> Callable[[torch.Tensor, torch.Tensor], torch.Tensor]:
    """`cross_entropy` of plain-tensor logits through torch.compile (parallel.compile): inductor fuses the fp32
    upcast, log-softmax and target pick into one pass forward and one backward, where eager writes the fp32
    log-softmax, then a zero-filled gradient of the same size and its scatter (benchmarks/train/rowwise_ce.py times
    both)."""
    return torch.compile(_token_cross_entropy)


def logsumexp(logits: torch.Tensor) -> torch.Tensor:
    """logsumexp over the last dim; of vocabulary-split logits from each shard's max and sum of exponentials (two
    all-reduces of one number per token), a plain tensor either way."""
    if not vocab_parallel(logits):
        return torch.logsumexp(logits, dim=-1)
    whole = [Replicate()] * logits.device_mesh.ndim
    top = logits.detach().amax(dim=-1, keepdim=True).redistribute(placements=whole)
    total = (logits - top).exp().sum(dim=-1).redistribute(placements=whole)
    return (top.squeeze(-1) + total.log()).full_tensor()


def z_loss(logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    """Mean of logsumexp(logits)^2 over the labelled tokens (PaLM's z-loss, unweighted)."""
    valid = (labels != IGNORE_INDEX).flatten()
    lse = logsumexp(logits.float().flatten(0, 1))
    return (lse.square() * valid).sum() / valid.sum().clamp(min=1)


@dataclass
class CrossEntropyLoss(CrossEntropyOptions):
    """Mean token cross-entropy of the logits, plus an optional z-loss. (Its fields are conf/loss's options,
    declared in forge.train.loss_options: the schema is that dataclass with a `_target_`.)"""

    _compiled = False  # set by compile(); a plain attribute, not a field, so not a conf/loss option

    def compile(self) -> None:
        """Take the cross-entropy of plain logits through torch.compile from now on (parallel.compile)."""
        self._compiled = True

    def __call__(
        self, model: nn.Module, inputs: torch.Tensor, labels: torch.Tensor, attn_mask: torch.Tensor | None = None
    ) -> torch.Tensor:
        logits = model(inputs, attn_mask=attn_mask)
        if isinstance(logits, DTensor):  # split over the vocabulary (tp): torch's loss_parallel
            loss = cross_entropy(logits, labels)
        elif self._compiled:
            loss = compiled_cross_entropy()(logits, labels)
        else:
            return rowwise_cross_entropy(logits, labels, self.z_loss_weight)
        if self.z_loss_weight:
            loss = loss + self.z_loss_weight * z_loss(logits, labels)
        return loss


@dataclass
class ChunkedCrossEntropyLoss(ChunkedCrossEntropyOptions):
    """Cross-entropy with the output head applied a chunk of tokens at a time: the (tokens x vocab) logits are
    never held at once; loss and gradients equal CrossEntropyLoss's. (Its fields: forge.train.loss_options.)

    Needs a model whose forward takes `head=False` and whose head is `model.output` without a bias (forge's
    Transformer and the VLMs, also under FSDP: the root module, which holds the head, keeps its parameters
    gathered from forward to backward).
    """

    def __call__(
        self, model: nn.Module, inputs: torch.Tensor, labels: torch.Tensor, attn_mask: torch.Tensor | None = None
    ) -> torch.Tensor:
        hidden = model(inputs, attn_mask=attn_mask, head=False)
        head = model.output
        if head.bias is not None:
            raise NotImplementedError("chunked cross-entropy needs an output head without a bias")
        return linear_cross_entropy(
            hidden.flatten(0, 1), head.weight, labels.flatten(), self.chunk_size, self.z_loss_weight
        )


def linear_cross_entropy(
    hidden: torch.Tensor, weight: torch.Tensor, labels: torch.Tensor, chunk_size: int, z_loss_weight: float = 0.0
) -> torch.Tensor:
    """Mean over labelled tokens of CE(hidden @ weight.T, labels) + z_loss_weight * logsumexp^2, in chunks.

    hidden (tokens, dim), weight (vocab, dim), labels (tokens,). Differentiable in hidden and weight.
    """
    if torch.is_grad_enabled() and (hidden.requires_grad or weight.requires_grad):
        return _LinearCrossEntropy.apply(hidden, weight, labels, chunk_size, z_loss_weight)
    return _chunked_loss(hidden, weight, labels, chunk_size, z_loss_weight, None)


def _chunked_loss(
    hidden: torch.Tensor,
    weight: torch.Tensor,
    labels: torch.Tensor,
    chunk_size: int,
    z_loss_weight: float,
    grads: tuple[torch.Tensor, torch.Tensor] | None,
) -> torch.Tensor:
    """The loss; when `grads` = (grad_hidden, grad_weight fp32) is given, also fills in the loss's gradients."""
    valid_all = labels != IGNORE_INDEX
    count = valid_all.sum().clamp(min=1)
    total = torch.zeros((), dtype=torch.float32, device=hidden.device)
    for start in range(0, hidden.shape[0], chunk_size):
        end = start + chunk_size
        h, valid = hidden[start:end], valid_all[start:end]
        targets = labels[start:end].clamp(min=0)[:, None]
        logits = F.linear(h, weight).float()  # under autocast: a bf16 matmul, as in the plain path
        log_probs = torch.log_softmax(logits, dim=-1)
        target_log_prob = log_probs.gather(1, targets).squeeze(1)
        per_token = -target_log_prob
        if z_loss_weight:
            lse = logits.gather(1, targets).squeeze(1) - target_log_prob  # log Z = logit - log p, any column
            per_token = per_token + z_loss_weight * lse.square()
        total = total + (per_token * valid).sum()
        if grads is None:
            continue
        del logits
        grad_hidden, grad_weight = grads
        # d/dlogits of -log p[y] + w lse^2 = a * (softmax - onehot(y) / (1 + 2 w lse)) with the row factor
        # a = 1 + 2 w lse (1 without z-loss); a and the 1/count mean scale the small matmul operands instead of
        # the (chunk x vocab) block, which is touched only by the exp and one scatter.
        row = valid / count
        dlogits = log_probs.exp_()
        if z_loss_weight:
            factor = 1 + 2 * z_loss_weight * lse
            dlogits.scatter_add_(1, targets, -(1 / factor)[:, None])
            row = row * factor
        else:
            dlogits.scatter_add_(1, targets, -torch.ones_like(row)[:, None])
        row = row[:, None]
        grad_hidden[start:end] = ((dlogits @ weight) * row).to(grad_hidden.dtype)
        grad_weight += (dlogits.mT @ (h * row)).float()
    return total / count


class _LinearCrossEntropy(torch.autograd.Function):
    """Chunked linear + cross-entropy whose gradients are computed in the forward pass (no logits are saved)."""

    @staticmethod
    def forward(ctx, hidden, weight, labels, chunk_size, z_loss_weight):
        grad_hidden = torch.empty_like(hidden)
        grad_weight = torch.zeros(weight.shape, dtype=torch.float32, device=weight.device)
        loss = _chunked_loss(hidden, weight, labels, chunk_size, z_loss_weight, (grad_hidden, grad_weight))
        ctx.weight_dtype = weight.dtype
        ctx.save_for_backward(grad_hidden, grad_weight)
        return loss

    @staticmethod
    def backward(ctx, grad_loss):
        grad_hidden, grad_weight = ctx.saved_tensors
        return grad_hidden * grad_loss, (grad_weight * grad_loss).to(ctx.weight_dtype), None, None, None
