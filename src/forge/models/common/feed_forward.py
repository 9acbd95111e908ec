"""The SwiGLU MLP of a dense block, also the shape of an MoE's shared experts and of the VLM towers' MLPs."""

import torch
import torch.nn.functional as F
from torch import nn

from forge.models.common.init_spec import InitSpec, apply_specs, trunc_normal


class FeedForward(nn.Module):
    """SwiGLU MLP: w2(silu(w1 x) * w3 x)."""

    def __init__(self, dim: int, hidden_dim: int):
        super().__init__()
        self.w1 = nn.Linear(dim, hidden_dim, bias=False)
        self.w2 = nn.Linear(hidden_dim, dim, bias=False)
        self.w3 = nn.Linear(dim, hidden_dim, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.w2(F.silu(self.w1(x)) * self.w3(x))

    def init_specs(self, std: float, out_std: float) -> dict[str, InitSpec]:
        return {"w1.weight": trunc_normal(std), "w3.weight": trunc_normal(std), "w2.weight": trunc_normal(out_std)}

    def init_weights(self, std: float, out_std: float) -> None:
        apply_specs(self, self.init_specs(std, out_std))
