"""bf16 compute weights for a model held whole on its rank: the fp32 weights stay the master copy, and the forwards
and backwards of one optimizer step run on one bf16 copy of them, as FSDP's mixed precision gathers sharded
weights (`parallel.param_dtype`)."""

from contextlib import nullcontext

import torch
from torch import nn
from torch.distributed.fsdp import FSDPModule
from torch.distributed.tensor import DTensor

from forge.parallel.plan import DTYPES


class ComputeWeights:
    """A scope (`with weights:`) in which the model's parameters hold `dtype` copies of their fp32 values.

    On entry each parameter's fp32 tensor is set aside and the parameter takes a copy in `dtype`: one cast per
    parameter per scope, where autocast casts each weight in every forward and casts its gradient back in every
    backward. Inside, each backward's gradient of a parameter is added to an fp32 gradient as soon as autograd has
    accumulated it, and then freed (a post-accumulate-grad hook): micro-batches sum in fp32, and no whole-model
    low-precision gradient is held. On exit the parameters hold their fp32 tensors again, with the fp32 gradients,
    for the clipping, the optimizer and the checkpoints, which never see the copies. The copies are freed on exit:
    between steps the model costs what it cost before (on a CPU, plus one 4 MiB buffer: add_in_pieces). Within one,
    the copies are alive while the backward needs them, as autocast's casts would be, plus those of the weights
    autocast does not cast (the embedding, the norms: 2 bytes per parameter) and, for a moment, one parameter's
    low-precision gradient beside its fp32 sum.

    With `fixed`, the copies are written into the same tensors every scope (allocated in the first) instead:
    replayed CUDA graphs (parallel.cuda_graphs) read the weights at the addresses they were recorded with. Between
    steps they then hold 2 bytes per parameter. (On a CPU, fresh copies each step were as fast: `make train` 0.99x
    with fixed copies and gradient sums.)

    Only for plain parameters (no FSDP, no DTensor): FSDP gathers its shards in parallel.param_dtype itself.
    """

    def __init__(self, model: nn.Module, dtype: torch.dtype = torch.bfloat16, fixed: bool = False):
        self.dtype, self.fixed = dtype, fixed
        self.params = [p for p in model.parameters() if p.is_floating_point() and p.dtype != dtype]
        self.masters: list[torch.Tensor | None] = [None] * len(self.params)
        self.copies: list[torch.Tensor | None] = [None] * len(self.params)  # kept between scopes when fixed
        self.grads: dict[nn.Parameter, torch.Tensor] = {}
        self.hooked: set[nn.Parameter] = set()
        self.scratch: torch.Tensor | None = None  # a CPU's fp32 piece of a gradient being summed (add_in_pieces)
        self.active = False

    def __enter__(self) -> "ComputeWeights":
        if self.active:  # a nested entry would set the copies aside as masters
            raise RuntimeError("ComputeWeights scopes do not nest")
        with torch.no_grad():
            for i, p in enumerate(self.params):
                if p.requires_grad and p not in self.hooked:  # a freeze schedule may thaw a parameter later
                    p.register_post_accumulate_grad_hook(self._take_grad)
                    self.hooked.add(p)
                if p.grad is not None:  # a gradient left from outside the scope keeps adding up in fp32
                    self.grads[p] = p.grad
                    p.grad = None
                self.masters[i] = p.data
                p.data = self._copy(i, p.data)
        self.active = True
        return self

    def __exit__(self, *exc) -> None:
        self.active = False
        for i, p in enumerate(self.params):
            p.data, self.masters[i] = self.masters[i], None
            p.grad = self.grads.pop(p, None)

    def _copy(self, i: int, master: torch.Tensor) -> torch.Tensor:
        """Parameter i's copy in the compute dtype: a new tensor, or with `fixed` the same one rewritten."""
        copy = self.copies[i]
        if copy is None or copy.shape != master.shape or copy.device != master.device:
            copy = master.to(self.dtype)
            if self.fixed:
                self.copies[i] = copy
        else:
            copy.copy_(master)
        return copy

    def _take_grad(self, p: nn.Parameter) -> None:
        if not self.active:  # a backward outside the scope: the gradient is already the parameter's dtype
            return
        grad, p.grad = p.grad, None
        if p not in self.grads:
            self.grads[p] = grad.float()
        elif grad.is_cpu and grad.is_contiguous() and self.grads[p].is_contiguous():
            if self.scratch is None:
                self.scratch = torch.empty(SUM_PIECE, dtype=self.grads[p].dtype, device=grad.device)
            add_in_pieces(self.grads[p], grad, self.scratch)
        else:
            self.grads[p].add_(grad)


SUM_PIECE = 1 << 20
"""Elements per piece when a CPU adds a low-precision gradient into its fp32 sum. An in-place add across dtypes
takes torch's casting loop, several times slower on a CPU than a copy into fp32 and a plain fp32 add (the MoE
step's profile in benchmarks/moe/speed.py shows it); a piece of this size is one small reused buffer (4 MiB)."""


def add_in_pieces(total: torch.Tensor, grad: torch.Tensor, scratch: torch.Tensor) -> None:
    """total += grad, both contiguous, grad in a lower precision: each piece of grad copied into `scratch` (total's
    dtype), then added in total's dtype; the same values as total.add_(grad)."""
    size = scratch.numel()
    for whole, low in zip(total.view(-1).split(size), grad.view(-1).split(size), strict=True):
        piece = scratch[: low.numel()]
        piece.copy_(low)
        whole.add_(piece)


def has_plain_parameters(model: nn.Module) -> bool:
    """Whether the model's parameters are whole, plain tensors on this rank: no FSDP, no DTensor (TP)."""
    if any(isinstance(m, FSDPModule) for m in model.modules()):
        return False
    return not any(isinstance(p, DTensor) for p in model.parameters())


def compute_weights(model: nn.Module, dtype: str, fixed: bool = False) -> ComputeWeights | None:
    """The compute weights of a model with plain parameters whose parameters compute in `dtype` (bf16; see
    forge.parallel.plan.param_dtype); None otherwise (fp32, or FSDP / TP parameters). `fixed`: at the same
    addresses every step (for CUDA graphs)."""
    if dtype == "fp32" or not has_plain_parameters(model):
        return None
    return ComputeWeights(model, DTYPES[dtype], fixed)


def scope(weights: ComputeWeights | None):
    """`weights` as a scope, or no scope without them."""
    return weights if weights is not None else nullcontext()
