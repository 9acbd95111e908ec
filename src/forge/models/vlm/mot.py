"""Mixture-of-Transformers: every non-embedding parameter (norms, attention projections, FFN) is duplicated per
modality; one global self-attention runs over the visual and text tokens together."""

import torch
import torch.nn.functional as F
from torch import nn

from forge.models.common.init_spec import InitSpec, prefixed
from forge.models.common.kv_cache import KVCache
from forge.models.common.rope import apply_rope
from forge.models.llama.args import TransformerArgs
from forge.models.llama.transformer import TransformerBlock
from forge.models.vlm.base import PrefixVLM


def mot_block(
    text: TransformerBlock,
    image: TransformerBlock,
    h: torch.Tensor,
    n_visual: int,
    cos: torch.Tensor,
    sin: torch.Tensor,
    mask: torch.Tensor,
    cache: KVCache | None = None,
) -> torch.Tensor:
    """One layer: the first n_visual positions use `image`'s parameters, the rest `text`'s; attention is global
    (over the cached positions too, with a cache)."""
    batch, seq, _ = h.shape
    ta, ia = text.attention, image.attention
    xv, xt = image.attention_norm(h[:, :n_visual]), text.attention_norm(h[:, n_visual:])

    def project(img: nn.Module, txt: nn.Module) -> torch.Tensor:
        return torch.cat([img(xv), txt(xt)], dim=1).view(batch, seq, -1, ta.head_dim)

    q, k, v = project(ia.wq, ta.wq), project(ia.wk, ta.wk), project(ia.wv, ta.wv)
    if ta.q_norm is not None:
        q = torch.cat([ia.q_norm(q[:, :n_visual]), ta.q_norm(q[:, n_visual:])], dim=1)
        k = torch.cat([ia.k_norm(k[:, :n_visual]), ta.k_norm(k[:, n_visual:])], dim=1)
    q, k = apply_rope(q, cos, sin), apply_rope(k, cos, sin)
    q, k, v = (t.transpose(1, 2) for t in (q, k, v))
    if cache is not None:
        k, v = cache.update(text.layer_id, k, v)
    out = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, enable_gqa=q.shape[1] != k.shape[1])
    out = out.transpose(1, 2).reshape(batch, seq, -1)
    h = h + torch.cat([ia.wo(out[:, :n_visual]), ta.wo(out[:, n_visual:])], dim=1)
    fv = image.feed_forward(image.ffn_norm(h[:, :n_visual]))
    ft = text.feed_forward(text.ffn_norm(h[:, n_visual:]))
    return h + torch.cat([fv, ft], dim=1)


class MoTVLM(PrefixVLM):
    """The decoder's blocks serve the text tokens; `image_layers` (same shapes) serve the visual tokens."""

    def __init__(self, text: TransformerArgs, **kwargs):
        super().__init__(text, **kwargs)
        self.image_layers = nn.ModuleDict({str(i): TransformerBlock(i, text) for i in range(text.n_layers)})

    def fsdp_units(self) -> list[nn.Module]:
        """The projections and FFNs of both modalities (mot_block calls them, not the blocks' forward)."""
        units: list[nn.Module] = [self.connector]
        for key, text in self.decoder.layers.items():
            for block in (text, self.image_layers[key]):
                attn = block.attention
                units += [attn.wq, attn.wk, attn.wv, attn.wo, block.feed_forward]
        return units

    def extra_init_specs(self) -> dict[str, InitSpec]:
        std, out_std = self.init_stds()
        specs: dict[str, InitSpec] = {}
        for key, block in self.image_layers.items():
            specs |= prefixed(f"image_layers.{key}", block.init_specs(std, out_std))
        return specs

    def run_block(self, key: str, block, h, n_visual: int, valid, cos, sin, mask, cache=None) -> torch.Tensor:
        return mot_block(block, self.image_layers[key], h, n_visual, cos, sin, mask, cache)
