"""Multi-head latent attention (MLA, DeepSeek-V2 / V3): keys and values from one low-rank latent per token.

Per token, `wkv_a` projects the residual stream to a kv_lora_rank latent (RMS-normed) and one shared rotary key
of qk_rope_head_dim; `wkv_b` expands the latent to each head's non-rotary key (qk_nope_head_dim) and value
(v_head_dim). Queries come from `wq`, or with q_lora_rank through a normed low-rank pair `wq_a` / `wq_b`; each
head's query is [nope part, rotary part]. The score scale is 1 / sqrt(qk_nope_head_dim + qk_rope_head_dim).

RoPE rotates the two halves of the rotary part (rotate-half, as every forge attention); DeepSeek's checkpoints
interleave the pairs instead, which forge.models.llama.hf_config undoes by permuting those rows on import. The
latent norms use eps 1e-6, as DeepSeek's (and transformers') do whatever the model's norm_eps.

The KV cache holds the expanded keys and values (not the latent): decoding reads like the other attention.
"""

from collections.abc import Callable

import torch
import torch.nn.functional as F
from torch import nn

from forge.models.common.attention import Mask, attend, visible_keys
from forge.models.common.init_spec import ONES, InitSpec, apply_specs, trunc_normal
from forge.models.common.rope import apply_rope
from forge.models.llama.args import MLAArgs, TransformerArgs

LATENT_NORM_EPS = 1e-6


class LatentAttention(nn.Module):
    """MLA with the same call as forge's Attention: (x, cos, sin, mask, cache, layer_id)."""

    def __init__(self, args: TransformerArgs):
        super().__init__()
        mla: MLAArgs = args.mla
        self.nope, self.rope, self.v_dim = mla.qk_nope_head_dim, mla.qk_rope_head_dim, mla.v_head_dim
        self.kv_rank = mla.kv_lora_rank
        qk = self.nope + self.rope
        heads = args.n_heads
        if mla.q_lora_rank:
            self.wq_a = nn.Linear(args.dim, mla.q_lora_rank, bias=False)
            self.q_a_norm = nn.RMSNorm(mla.q_lora_rank, eps=LATENT_NORM_EPS)
            self.wq_b = nn.Linear(mla.q_lora_rank, heads * qk, bias=False)
        else:
            self.wq = nn.Linear(args.dim, heads * qk, bias=False)
        self.wkv_a = nn.Linear(args.dim, self.kv_rank + self.rope, bias=False)
        self.kv_a_norm = nn.RMSNorm(self.kv_rank, eps=LATENT_NORM_EPS)
        self.wkv_b = nn.Linear(self.kv_rank, heads * (self.nope + self.v_dim), bias=False)
        self.wo = nn.Linear(heads * self.v_dim, args.dim, bias=False)
        # set by context parallelism, as on forge.models.llama.transformer.Attention
        self.gather_kv: Callable[[torch.Tensor], torch.Tensor] | None = None

    def queries(self, x: torch.Tensor) -> torch.Tensor:
        if hasattr(self, "wq"):
            return self.wq(x)
        return self.wq_b(self.q_a_norm(self.wq_a(x)))

    def forward(
        self,
        x: torch.Tensor,
        cos: torch.Tensor,
        sin: torch.Tensor,
        attn_mask: Mask = None,
        cache=None,
        layer_id: int = 0,
    ) -> torch.Tensor:
        batch, seq, _ = x.shape
        q = self.queries(x).view(batch, seq, -1, self.nope + self.rope)
        q_nope, q_rope = q.split([self.nope, self.rope], dim=-1)
        latent, k_rope = self.wkv_a(x).split([self.kv_rank, self.rope], dim=-1)
        kv = self.wkv_b(self.kv_a_norm(latent)).view(batch, seq, -1, self.nope + self.v_dim)
        k_nope, v = kv.split([self.nope, self.v_dim], dim=-1)
        q_rope, k_rope = apply_rope(q_rope, cos, sin), apply_rope(k_rope[:, :, None], cos, sin)
        q = torch.cat([q_nope, q_rope], dim=-1)
        k = torch.cat([k_nope, k_rope.expand(-1, -1, k_nope.shape[2], -1)], dim=-1)
        q, k, v = (t.transpose(1, 2) for t in (q, k, v))
        k, v = visible_keys(k, v, cache, layer_id, self.gather_kv)
        # SDPA's fused CPU and CUDA kernels want one head width for q, k and v (else the math path holds the
        # (seq, seq) weights): pad the values to the query width and drop the padding after
        pad = q.shape[-1] - self.v_dim
        out = attend(q, k, F.pad(v, (0, pad)) if pad > 0 else v, attn_mask)[..., : self.v_dim]
        return self.wo(out.transpose(1, 2).reshape(batch, seq, -1))

    def init_specs(self, std: float, out_std: float) -> dict[str, InitSpec]:
        names = ("wq_a", "wq_b", "wkv_a", "wkv_b") if hasattr(self, "wq_a") else ("wq", "wkv_a", "wkv_b")
        specs = {f"{name}.weight": trunc_normal(std) for name in names}
        specs["wo.weight"] = trunc_normal(out_std)
        specs["kv_a_norm.weight"] = ONES
        if hasattr(self, "q_a_norm"):
            specs["q_a_norm.weight"] = ONES
        return specs

    def init_weights(self, std: float, out_std: float) -> None:
        apply_specs(self, self.init_specs(std, out_std))
