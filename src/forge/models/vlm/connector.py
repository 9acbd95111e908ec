"""Connectors from vision features (images, tokens, width) to decoder embeddings (images, tokens', dim).

linear and mlp keep the token count; avgpool and attnpool reduce it to `tokens` per image.
"""

import math

import torch
import torch.nn.functional as F
from torch import nn

from forge.models.common.init_spec import ONES, ZEROS, InitSpec, trunc_normal
from forge.models.vlm.args import POOLING_CONNECTORS


class LinearConnector(nn.Module):
    def __init__(self, width: int, dim: int):
        super().__init__()
        self.proj = nn.Linear(width, dim)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.proj(x)


class MLPConnector(nn.Module):
    """Two layers with a GELU between (LLaVA-1.5's projector)."""

    def __init__(self, width: int, dim: int):
        super().__init__()
        self.fc1 = nn.Linear(width, dim)
        self.fc2 = nn.Linear(dim, dim)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc2(F.gelu(self.fc1(x)))


class AvgPoolConnector(nn.Module):
    """Average pooling of the token sequence down to `tokens`, then a linear projection."""

    def __init__(self, width: int, dim: int, tokens: int):
        super().__init__()
        self.tokens = tokens
        self.proj = nn.Linear(width, dim)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        pooled = F.adaptive_avg_pool1d(x.transpose(1, 2), self.tokens).transpose(1, 2)
        return self.proj(pooled)


class AttnPoolConnector(nn.Module):
    """`tokens` learned queries attend over the features (one multi-head attention), then a projection."""

    def __init__(self, width: int, dim: int, tokens: int, heads: int = 4):
        super().__init__()
        heads = math.gcd(heads, width)
        self.queries = nn.Parameter(torch.empty(tokens, width))
        self.attention = nn.MultiheadAttention(width, heads, batch_first=True)
        self.norm = nn.LayerNorm(width)
        self.proj = nn.Linear(width, dim)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        queries = self.queries[None].expand(x.shape[0], -1, -1).to(x.dtype)
        pooled, _ = self.attention(queries, x, x, need_weights=False)
        return self.proj(self.norm(pooled))


def build_connector(kind: str, width: int, dim: int, tokens: int | None) -> nn.Module:
    """The `kind` connector from vision width to decoder dim; pooling kinds need `tokens` (per image)."""
    if kind == "linear":
        return LinearConnector(width, dim)
    if kind == "mlp":
        return MLPConnector(width, dim)
    if kind in POOLING_CONNECTORS:
        if not tokens or tokens < 1:
            raise ValueError(f"vlm.connector={kind} needs vlm.connector_tokens >= 1 (got {tokens})")
        return AvgPoolConnector(width, dim, tokens) if kind == "avgpool" else AttnPoolConnector(width, dim, tokens)
    raise ValueError(f"vlm.connector={kind!r} is not a connector (forge.models.vlm.args.Connector lists them)")


def connector_init_specs(module: nn.Module, std: float = 0.02) -> dict[str, InitSpec]:
    """How a connector's parameters start, by name: matrices and attnpool's queries truncated normal (`std`),
    biases zero, norm weights one."""
    specs = {}
    for name, _ in module.named_parameters():
        owner = module.get_submodule(name.rpartition(".")[0])
        if name.rpartition(".")[2].endswith("bias"):
            specs[name] = ZEROS
        elif isinstance(owner, nn.LayerNorm):
            specs[name] = ONES
        else:
            specs[name] = trunc_normal(std)
    return specs
