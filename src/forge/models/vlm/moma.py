"""MoMa: modality-aware mixture of experts. Attention is shared; each token goes to its modality's expert group,
and inside a group experts choose their tokens (expert-choice routing: each expert takes the top
capacity_factor * tokens / experts tokens of a sequence by router score, weighted by that score).

The text group's first expert is the decoder block's own FFN (so a text model upcycles into MoMa). Routing is per
sequence, so a sample's output never depends on the other samples of its batch. As in the MoMa paper, expert
choice looks at the whole sequence, so during training a text token's routing can depend on later tokens.
Padded (masked) visual tokens are never preferred over real ones and get a zero weight.
"""

import math

import torch
from torch import nn

from forge.models.common.feed_forward import FeedForward
from forge.models.common.init_spec import InitSpec, prefixed, trunc_normal
from forge.models.llama.args import TransformerArgs
from forge.models.llama.transformer import TransformerBlock
from forge.models.vlm.base import PrefixVLM, VisionLanguageModel


class ExpertChoiceGroup(nn.Module):
    """Experts of one modality with expert-choice routing over the tokens of each sequence."""

    def __init__(self, dim: int, hidden: int, n_new_experts: int, n_shared: int, capacity_factor: float):
        super().__init__()
        self.n_experts = n_new_experts + n_shared
        self.capacity_factor = capacity_factor
        self.router = nn.Linear(dim, self.n_experts, bias=False)
        self.experts = nn.ModuleList(FeedForward(dim, hidden) for _ in range(n_new_experts))

    def forward(self, x: torch.Tensor, valid: torch.Tensor, shared: list[nn.Module]) -> torch.Tensor:
        batch, seq, dim = x.shape
        experts = [*shared, *self.experts]
        scores = torch.softmax(self.router(x).float(), dim=-1)  # (batch, seq, experts), in [0, 1]
        capacity = min(seq, max(1, math.ceil(self.capacity_factor * seq / self.n_experts)))
        gate, index = scores.masked_fill(~valid[..., None], -1.0).topk(capacity, dim=1)  # per expert: its tokens
        out = torch.zeros_like(x)
        for e, expert in enumerate(experts):
            chosen = index[:, :, e]
            weight = gate[:, :, e].clamp_min(0) * valid.gather(1, chosen)
            where = chosen[..., None].expand(-1, -1, dim)
            out = out.scatter_add(1, where, expert(x.gather(1, where)) * weight[..., None].to(x.dtype))
        return out

    def init_specs(self, std: float, out_std: float) -> dict[str, InitSpec]:
        """The router truncated normal (`std`), each expert as a block's FFN."""
        specs = {"router.weight": trunc_normal(std)}
        for index, expert in enumerate(self.experts):
            specs |= prefixed(f"experts.{index}", expert.init_specs(std, out_std))
        return specs


class MoMaLayer(nn.Module):
    """The two modality groups of one block."""

    def __init__(self, args: TransformerArgs, text_experts: int, image_experts: int, capacity_factor: float):
        super().__init__()
        self.text = ExpertChoiceGroup(args.dim, args.hidden_dim, text_experts - 1, 1, capacity_factor)
        self.image = ExpertChoiceGroup(args.dim, args.hidden_dim, image_experts, 0, capacity_factor)


class MoMaVLM(PrefixVLM):
    """Visual tokens then text through shared attention; FFNs replaced by per-modality expert-choice groups.

    No KV cache: expert choice ranks the tokens of the whole sequence, so a new token can change how the earlier
    ones were routed, and generation recomputes the sequence at each step.
    """

    supports_kv_cache = False
    prefill = VisionLanguageModel.prefill  # both raise
    decode = VisionLanguageModel.decode

    def __init__(
        self,
        text: TransformerArgs,
        *,
        text_experts: int,
        image_experts: int,
        capacity_factor: float,
        **kwargs,
    ):
        super().__init__(text, **kwargs)
        if text_experts < 1 or image_experts < 1:
            raise ValueError(f"vlm.text_experts={text_experts} and vlm.image_experts={image_experts} must be >= 1")
        if capacity_factor <= 0:
            raise ValueError(f"vlm.capacity_factor={capacity_factor} must be > 0")
        self.moma_layers = nn.ModuleDict(
            {str(i): MoMaLayer(text, text_experts, image_experts, capacity_factor) for i in range(text.n_layers)}
        )

    def fsdp_units(self) -> list[nn.Module]:
        """Attention, the shared FFN and both expert groups of every block (called directly, not via the block)."""
        units: list[nn.Module] = [self.connector]
        for key, block in self.decoder.layers.items():
            layer = self.moma_layers[key]
            units += [block.attention, block.feed_forward, layer.text, layer.image]
        return units

    def extra_init_specs(self) -> dict[str, InitSpec]:
        std, out_std = self.init_stds()
        specs: dict[str, InitSpec] = {}
        for key, layer in self.moma_layers.items():
            specs |= prefixed(f"moma_layers.{key}.text", layer.text.init_specs(std, out_std))
            specs |= prefixed(f"moma_layers.{key}.image", layer.image.init_specs(std, out_std))
        return specs

    def run_block(
        self, key: str, block: TransformerBlock, h, n_visual: int, valid, cos, sin, mask, cache=None
    ) -> torch.Tensor:
        layer = self.moma_layers[key]
        h = h + block.attention(block.attention_norm(h), cos, sin, mask, layer_id=block.layer_id)
        x = block.ffn_norm(h)
        text_valid = torch.ones(x.shape[0], x.shape[1] - n_visual, dtype=torch.bool, device=x.device)
        fv = layer.image(x[:, :n_visual], valid, [])
        ft = layer.text(x[:, n_visual:], text_valid, [block.feed_forward])
        return h + torch.cat([fv, ft], dim=1)
