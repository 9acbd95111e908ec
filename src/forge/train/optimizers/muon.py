"""Muon (Keller Jordan 2024, "Muon: An optimizer for hidden layers in neural networks").

For each hidden weight matrix, with gradient g and momentum buffer b:

    b      = momentum * b + (1 - momentum) * g
    u      = (1 - momentum) * g + momentum * b      (Nesterov; u = b without it)
    O      = NewtonSchulz5(u)                       (approximately U V^T of u = U S V^T)
    p      = p * (1 - lr * weight_decay) - lr * max(1, rows / cols) ** 0.5 * O

Newton-Schulz runs `ns_steps` iterations of X <- a X + (b A + c A^2) X with A = X X^T, (a, b, c) = (3.4445, -4.7750,
2.0315), on X = u / ||u||_F (transposed when it has more rows than columns), in bf16 by default. A 3-D parameter
(stacked MoE experts) is orthogonalised per expert. Embeddings, the output head and 1-D parameters (norms,
biases) are not hidden matrices: they take AdamW steps in the same optimizer (`use_muon=False` groups), which is
how `muon_with_adamw` builds it.

Under FSDP (or TP) a parameter is a DTensor holding a shard, but the orthogonalisation needs the whole matrix: the
update is gathered (`full_tensor`), orthogonalised identically on every rank, and each rank keeps its own shard
(`distribute_tensor` slicing locally, no further communication). Every rank computes every matrix; spreading the
matrices over ranks would save that work, at the cost of a second exchange.
"""

from collections.abc import Iterable, Sequence

import torch
from torch import nn
from torch.distributed.tensor import DTensor, distribute_tensor

NS_COEFFICIENTS = (3.4445, -4.7750, 2.0315)


def newton_schulz(update: torch.Tensor, steps: int, bf16: bool = True) -> torch.Tensor:
    """The quintic Newton-Schulz orthogonalisation of the last two dimensions of a >= 2-D tensor."""
    a, b, c = NS_COEFFICIENTS
    x = update.bfloat16() if bf16 else update.float()
    tall = update.size(-2) > update.size(-1)
    if tall:
        x = x.mT
    x = x / (x.norm(dim=(-2, -1), keepdim=True) + 1e-7)
    for _ in range(steps):
        gram = x @ x.mT
        x = a * x + (b * gram + c * gram @ gram) @ x
    return x.mT if tall else x


def orthogonalize(update: torch.Tensor, steps: int, bf16: bool) -> torch.Tensor:
    """newton_schulz of the whole matrix, scaled by max(1, rows / cols) ** 0.5, in update's dtype and layout."""
    rows, cols = update.shape[-2:]
    scale = max(1.0, rows / cols) ** 0.5
    if isinstance(update, DTensor):
        full = newton_schulz(update.full_tensor(), steps, bf16).to(update.dtype) * scale
        return distribute_tensor(full, update.device_mesh, update.placements, src_data_rank=None)
    return newton_schulz(update, steps, bf16).to(update.dtype) * scale


class Muon(torch.optim.Optimizer):
    """Muon for groups with use_muon=True (the default), AdamW for groups with use_muon=False.

    Muon groups read lr, momentum, nesterov, ns_steps, ns_bf16 and weight_decay; AdamW groups read lr, betas, eps
    and weight_decay (decoupled, as in torch.optim.AdamW).
    """

    def __init__(
        self,
        params: Iterable,
        lr: float = 0.02,
        momentum: float = 0.95,
        nesterov: bool = True,
        ns_steps: int = 5,
        ns_bf16: bool = True,
        weight_decay: float = 0.0,
        betas: tuple[float, float] = (0.9, 0.95),
        eps: float = 1e-8,
    ):
        defaults = {
            "lr": lr,
            "momentum": momentum,
            "nesterov": nesterov,
            "ns_steps": ns_steps,
            "ns_bf16": ns_bf16,
            "weight_decay": weight_decay,
            "betas": tuple(betas),
            "eps": eps,
            "use_muon": True,
        }
        super().__init__(params, defaults)

    @torch.no_grad()
    def step(self, closure=None):
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        for group in self.param_groups:
            if group["use_muon"]:
                self._muon_step(group)
            else:
                self._adamw_step(group)
        return loss

    def _muon_step(self, group: dict) -> None:
        lr, beta = group["lr"], group["momentum"]
        for p in group["params"]:
            # A missing gradient counts as zero (as in the reference code), so every rank runs the same gathers.
            grad = p.grad if p.grad is not None else torch.zeros_like(p)
            state = self.state[p]
            if "momentum_buffer" not in state:
                state["momentum_buffer"] = torch.zeros_like(p)
            buf = state["momentum_buffer"]
            buf.lerp_(grad, 1 - beta)
            update = grad.lerp(buf, beta) if group["nesterov"] else buf
            if group["weight_decay"] != 0:
                p.mul_(1 - lr * group["weight_decay"])
            p.add_(orthogonalize(update, group["ns_steps"], group["ns_bf16"]), alpha=-lr)

    def _adamw_step(self, group: dict) -> None:
        params = [p for p in group["params"] if p.grad is not None]
        if not params:
            return
        for p in params:
            state = self.state[p]
            if "step" not in state:
                state["step"] = torch.zeros((), dtype=torch.float32)
                state["exp_avg"] = torch.zeros_like(p)
                state["exp_avg_sq"] = torch.zeros_like(p)
        states = [self.state[p] for p in params]
        grads = [p.grad for p in params]
        exp_avgs = [s["exp_avg"] for s in states]
        exp_avg_sqs = [s["exp_avg_sq"] for s in states]
        (beta1, beta2), lr, eps = group["betas"], group["lr"], group["eps"]
        for s in states:
            s["step"] += 1
        step = states[0]["step"].item()  # the params of a group always step together
        if group["weight_decay"] != 0:
            torch._foreach_mul_(params, 1 - lr * group["weight_decay"])
        torch._foreach_lerp_(exp_avgs, grads, 1 - beta1)
        torch._foreach_mul_(exp_avg_sqs, beta2)
        torch._foreach_addcmul_(exp_avg_sqs, grads, grads, value=1 - beta2)
        denom = torch._foreach_sqrt(exp_avg_sqs)
        torch._foreach_div_(denom, (1 - beta2**step) ** 0.5)
        torch._foreach_add_(denom, eps)
        torch._foreach_addcdiv_(params, exp_avgs, denom, value=-lr / (1 - beta1**step))


def split_params(
    model: nn.Module, adamw_params: Sequence[str]
) -> tuple[list[nn.Parameter], list[nn.Parameter], list[nn.Parameter]]:
    """(hidden matrices for Muon, other >=2-D weights for AdamW with decay, embeddings and 1-D for AdamW without).

    A parameter goes to AdamW when it is 1-D, belongs to an nn.Embedding (a tied head included), or its name is
    one of `adamw_params` or ends with "." + one of them (wrapper prefixes such as a pipeline stage's do not
    matter).
    """
    embeddings = {id(p) for m in model.modules() if isinstance(m, nn.Embedding) for p in m.parameters(recurse=False)}
    muon, adamw, no_decay = [], [], []
    for name, param in model.named_parameters():
        if not param.requires_grad:
            continue
        if param.ndim < 2 or id(param) in embeddings:
            no_decay.append(param)
        elif any(name == s or name.endswith("." + s) for s in adamw_params):
            adamw.append(param)
        else:
            muon.append(param)
    return muon, adamw, no_decay


def muon_with_adamw(
    model: nn.Module,
    lr: float,
    momentum: float,
    nesterov: bool,
    ns_steps: int,
    ns_bf16: bool,
    weight_decay: float,
    adamw_lr: float,
    adamw_betas: Sequence[float],
    adamw_eps: float,
    adamw_weight_decay: float,
    adamw_params: Sequence[str],
) -> Muon:
    """Muon for the model's hidden matrices, AdamW (lr adamw_lr) for the head, embeddings and 1-D parameters.

    Takes the model itself (not param groups) because the head is told apart from hidden matrices by name.
    """
    muon, adamw, no_decay = split_params(model, list(adamw_params))
    aux = {"use_muon": False, "lr": adamw_lr, "betas": tuple(adamw_betas), "eps": adamw_eps}
    groups = [
        {"params": muon, "use_muon": True, "weight_decay": weight_decay},
        {"params": adamw, **aux, "weight_decay": adamw_weight_decay},
        {"params": no_decay, **aux, "weight_decay": 0.0},
    ]
    return Muon(
        [g for g in groups if g["params"]],
        lr=lr,
        momentum=momentum,
        nesterov=nesterov,
        ns_steps=ns_steps,
        ns_bf16=ns_bf16,
        weight_decay=weight_decay,
    )
