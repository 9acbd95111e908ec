"""Cross-attention (Flamingo / Llama-3.2-Vision style): the text stream alone runs through the decoder, and
gated cross-attention blocks every k layers read the visual tokens. The gates start at zero, so at step 0 the
model is exactly the text model."""

import torch
import torch.nn.functional as F
from torch import nn

from forge.models.common.feed_forward import FeedForward
from forge.models.common.init_spec import ONES, ZEROS, InitSpec, prefixed, trunc_normal
from forge.models.llama.args import TransformerArgs
from forge.models.vlm.base import VisionLanguageModel, VLMCache


class GatedCrossAttentionBlock(nn.Module):
    """x + tanh(g_attn) * xattn(norm(x), visual), then x + tanh(g_ffn) * ffn(norm(x)); g_* start at 0."""

    def __init__(self, args: TransformerArgs):
        super().__init__()
        self.n_heads = args.n_heads
        self.head_dim = args.head_size
        self.norm = nn.RMSNorm(args.dim, eps=args.norm_eps)
        self.wq = nn.Linear(args.dim, args.n_heads * args.head_size, bias=False)
        self.wk = nn.Linear(args.dim, args.n_heads * args.head_size, bias=False)
        self.wv = nn.Linear(args.dim, args.n_heads * args.head_size, bias=False)
        self.wo = nn.Linear(args.n_heads * args.head_size, args.dim, bias=False)
        self.ffn_norm = nn.RMSNorm(args.dim, eps=args.norm_eps)
        self.feed_forward = FeedForward(args.dim, args.hidden_dim)
        self.attn_gate = nn.Parameter(torch.zeros(1))
        self.ffn_gate = nn.Parameter(torch.zeros(1))

    def forward(self, x: torch.Tensor, visual: torch.Tensor, valid: torch.Tensor) -> torch.Tensor:
        batch, seq, _ = x.shape
        q = self.wq(self.norm(x)).view(batch, seq, self.n_heads, self.head_dim).transpose(1, 2)
        k = self.wk(visual).view(batch, -1, self.n_heads, self.head_dim).transpose(1, 2)
        v = self.wv(visual).view(batch, -1, self.n_heads, self.head_dim).transpose(1, 2)
        out = F.scaled_dot_product_attention(q, k, v, attn_mask=valid[:, None, None, :])
        x = x + torch.tanh(self.attn_gate) * self.wo(out.transpose(1, 2).reshape(batch, seq, -1))
        return x + torch.tanh(self.ffn_gate) * self.feed_forward(self.ffn_norm(x))

    def init_specs(self, std: float) -> dict[str, InitSpec]:
        """Projections and FFN truncated normal (`std`), norms one, gates zero (the block starts as identity)."""
        specs = {f"{name}.weight": trunc_normal(std) for name in ("wq", "wk", "wv", "wo")}
        specs |= {"norm.weight": ONES, "ffn_norm.weight": ONES, "attn_gate": ZEROS, "ffn_gate": ZEROS}
        return specs | prefixed("feed_forward", self.feed_forward.init_specs(std, std))


class CrossAttentionVLM(VisionLanguageModel):
    """Decoder blocks with a gated cross-attention block after every `cross_attention_every`-th one."""

    def __init__(self, text: TransformerArgs, *, cross_attention_every: int, **kwargs):
        super().__init__(text, **kwargs)
        if cross_attention_every < 1:
            raise ValueError(f"vlm.cross_attention_every={cross_attention_every} must be >= 1")
        self.cross_attention_every = cross_attention_every
        self.cross_layers = nn.ModuleDict(
            {
                str(i): GatedCrossAttentionBlock(text)
                for i in range(text.n_layers)
                if (i + 1) % cross_attention_every == 0
            }
        )

    def fsdp_units(self) -> list[nn.Module]:
        return [*super().fsdp_units(), *self.cross_layers.values()]

    def extra_init_specs(self) -> dict[str, InitSpec]:
        std = self.text_args.init_std
        specs: dict[str, InitSpec] = {}
        for key, block in self.cross_layers.items():
            specs |= prefixed(f"cross_layers.{key}", block.init_specs(std))
        return specs

    def forward(
        self,
        tokens: torch.Tensor,
        pixels: torch.Tensor,
        frame_mask: torch.Tensor,
        frame_times: torch.Tensor | None = None,
        head: bool = True,
    ) -> torch.Tensor:
        visual, valid = self.encode_media(pixels, frame_mask, frame_times)
        return self._run(self.decoder.tok_embeddings(tokens), visual, valid, None, None, head=head)

    def prefill(self, tokens, pixels, frame_mask, frame_times, cache: VLMCache) -> torch.Tensor:
        visual, valid = self.encode_media(pixels, frame_mask, frame_times)
        cache.visual, cache.visual_valid = visual, valid
        cache.key_valid = torch.ones_like(tokens, dtype=torch.bool)
        return self._run(self.decoder.tok_embeddings(tokens), visual, valid, None, cache)

    def decode(self, tokens: torch.Tensor, cache: VLMCache) -> torch.Tensor:
        start = cache.length
        mask = cache.extend_keys(tokens.shape[1])
        return self._run(self.decoder.tok_embeddings(tokens), cache.visual, cache.visual_valid, mask, cache, start)

    def _run(self, h, visual, valid, mask, cache: VLMCache | None, start: int = 0, head: bool = True) -> torch.Tensor:
        """The text stream through the blocks (self-attention over the cache, if any; causal when mask is None)
        and the gated cross-attention to the visual tokens."""
        visual = visual.to(h.dtype)
        cos, sin = self.rope_at(start, h.shape[1])
        for key, block in self.decoder.layers.items():
            h = self.run_block(key, block, h, visual, valid, cos, sin, mask, cache)
        return self.head(h, head)

    def run_block(self, key: str, block, h, visual, valid, cos, sin, mask, cache=None) -> torch.Tensor:
        """One decoder block, then its gated cross-attention block if it has one."""
        h = block(h, cos, sin, mask, cache)
        if key in self.cross_layers:
            h = self.cross_layers[key](h, visual, valid)
        return h
