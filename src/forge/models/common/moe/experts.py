"""Routed experts as stacked 3-D weights, so expert parallelism can keep a slice of the leading dimension.

Layout matches `torch._grouped_mm(x, w)` (x @ w): w1 and w3 are (experts, dim, hidden), w2 is (experts, hidden, dim).
Tokens arrive grouped by expert: rows [0, counts[0]) go to the first local expert, and so on.
"""

from collections.abc import Callable

import torch
import torch.nn.functional as F
from torch import nn

from forge.models.common.init_spec import InitSpec, trunc_normal

WeightView = Callable[[torch.Tensor], torch.Tensor]
"""Maps a stacked expert weight to the plain tensor of this process's experts (expert parallelism passes one)."""


def grouped_mm_available() -> bool:
    """torch._grouped_mm exists in this build (CUDA sm90+, and CPU in recent releases)."""
    return hasattr(torch, "_grouped_mm")


class GroupedExperts(nn.Module):
    """`num_local` SwiGLU experts out of `num_experts`, starting at global id `first`."""

    def __init__(self, dim: int, hidden: int, num_experts: int, use_grouped_mm: bool = False):
        super().__init__()
        self.num_experts, self.first, self.num_local = num_experts, 0, num_experts
        self.use_grouped_mm = use_grouped_mm and grouped_mm_available()
        self.w1 = nn.Parameter(torch.empty(num_experts, dim, hidden))
        self.w2 = nn.Parameter(torch.empty(num_experts, hidden, dim))
        self.w3 = nn.Parameter(torch.empty(num_experts, dim, hidden))

    def keep_slice(self, first: int, count: int) -> None:
        """Keep only experts [first, first + count) (works on the meta device too); used by expert parallelism."""
        for name in ("w1", "w2", "w3"):
            full = getattr(self, name)
            setattr(self, name, nn.Parameter(full.detach()[first : first + count].clone()))
        self.first, self.num_local = first, count

    def forward(self, x: torch.Tensor, counts: torch.Tensor, view: WeightView | None = None) -> torch.Tensor:
        """x (N, dim) grouped by local expert, counts (num_local,) int64 -> (N, dim).

        `view` is applied to w1, w2 and w3 inside forward (after any wrapper's pre-forward hook gathered them):
        expert parallelism passes one that returns the local part of its sharded parameters.
        """
        weights = (view(self.w1), view(self.w2), view(self.w3)) if view is not None else None
        if self.use_grouped_mm:
            return self.forward_grouped(x, counts, weights)
        return self.forward_loop(x, counts, weights)

    def forward_loop(self, x: torch.Tensor, counts: torch.Tensor, weights: tuple | None = None) -> torch.Tensor:
        """One matmul chain per expert: the reference path (any dtype, any device); weights: (w1, w2, w3)."""
        w1, w2, w3 = weights or (self.w1, self.w2, self.w3)
        outs = []
        for e, chunk in enumerate(x.split(counts.tolist())):
            h = F.silu(chunk @ w1[e]) * (chunk @ w3[e])
            outs.append(h @ w2[e])
        return torch.cat(outs) if outs else x.new_zeros(0, x.shape[-1])

    def forward_grouped(self, x: torch.Tensor, counts: torch.Tensor, weights: tuple | None = None) -> torch.Tensor:
        """All experts in three grouped GEMMs. bf16 needs dim and hidden to be multiples of 8 (16-byte strides)."""
        w1, w2, w3 = weights or (self.w1, self.w2, self.w3)
        if torch.is_autocast_enabled(x.device.type):
            dtype = torch.get_autocast_dtype(x.device.type)
            x, w1, w2, w3 = x.to(dtype), w1.to(dtype), w2.to(dtype), w3.to(dtype)
        else:
            w1, w2, w3 = w1.to(x.dtype), w2.to(x.dtype), w3.to(x.dtype)
        offs = counts.cumsum(0).to(torch.int32)
        h = F.silu(torch._grouped_mm(x, w1, offs=offs)) * torch._grouped_mm(x, w3, offs=offs)
        return torch._grouped_mm(h, w2, offs=offs)

    def init_specs(self, std: float, out_std: float) -> dict[str, InitSpec]:
        return {"w1": trunc_normal(std), "w3": trunc_normal(std), "w2": trunc_normal(out_std)}

    def init_weights(self, std: float, out_std: float) -> None:
        """Draw every global expert in order from the global generator and keep the local ones, so a slice
        initialises like the whole."""
        for name, spec in self.init_specs(std, out_std).items():
            param = getattr(self, name)
            scratch = torch.empty(param.shape[1:], device=param.device, dtype=param.dtype)
            for e in range(self.num_experts):
                spec.draw(scratch)
                local = e - self.first
                if 0 <= local < self.num_local:
                    with torch.no_grad():
                        param[local].copy_(scratch)
