"""Lion (Chen et al. 2023, "Symbolic Discovery of Optimization Algorithms").

Per parameter, with gradient g and momentum m:

    update = sign(beta1 * m + (1 - beta1) * g)
    p      = p * (1 - lr * weight_decay) - lr * update
    m      = beta2 * m + (1 - beta2) * g

Every element moves by exactly lr, so Lion wants a learning rate 3-10x smaller than AdamW's and a weight decay
3-10x larger. One state tensor per parameter (AdamW keeps two). Elementwise only, so DTensor shards need no
communication.
"""

from collections.abc import Iterable

import torch


class Lion(torch.optim.Optimizer):
    """Lion with decoupled weight decay; `weight_decay` of a group (e.g. 0 for norms) overrides the default."""

    def __init__(
        self,
        params: Iterable,
        lr: float,
        betas: tuple[float, float],
        weight_decay: float,
    ):
        if lr <= 0:
            raise ValueError(f"Lion: lr={lr} must be positive")
        if not all(0.0 <= b < 1.0 for b in betas):
            raise ValueError(f"Lion: betas={tuple(betas)} must lie in [0, 1)")
        super().__init__(params, {"lr": lr, "betas": tuple(betas), "weight_decay": weight_decay})

    @torch.no_grad()
    def step(self, closure=None):
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        for group in self.param_groups:
            params = [p for p in group["params"] if p.grad is not None]
            if not params:
                continue
            grads = [p.grad for p in params]
            for p in params:
                if "exp_avg" not in self.state[p]:
                    self.state[p]["exp_avg"] = torch.zeros_like(p)
            moms = [self.state[p]["exp_avg"] for p in params]
            beta1, beta2 = group["betas"]
            lr, decay = group["lr"], group["weight_decay"]
            updates = torch._foreach_lerp(moms, grads, 1 - beta1)
            torch._foreach_sign_(updates)
            if decay != 0:
                torch._foreach_mul_(params, 1 - lr * decay)
            torch._foreach_add_(params, updates, alpha=-lr)
            torch._foreach_lerp_(moms, grads, 1 - beta2)
        return loss
