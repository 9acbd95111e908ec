"""A Llama-style decoder in plain PyTorch.

Blocks live in an `nn.ModuleDict` keyed "0".."N-1" so parameter names survive a pipeline split, and the
embedding, final norm and output head may be None on a stage that holds only a slice of the model.
"""

import math
import zlib

import torch
import torch.nn.functional as F
from torch import nn

from forge.model.args import TransformerArgs
from forge.model.rope import apply_rope, rope_tables, rotate_half


class KVCache:
    """Keys and values of the positions already seen, per layer id, so incremental decoding feeds only new tokens."""

    def __init__(self):
        self.layers: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}

    @property
    def length(self) -> int:
        """Positions cached so far (the same in every layer)."""
        return next(iter(self.layers.values()))[0].shape[2] if self.layers else 0

    def update(self, layer_id: int, k: torch.Tensor, v: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Append (batch, heads, new, head_dim) keys and values; return all of this layer's so far."""
        if layer_id in self.layers:
            past_k, past_v = self.layers[layer_id]
            k, v = torch.cat([past_k, k], dim=2), torch.cat([past_v, v], dim=2)
        self.layers[layer_id] = (k, v)
        return k, v


def _rotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """apply_rope for shared (seq, head_dim) tables or per-sequence (batch, seq, head_dim) ones."""
    if cos.dim() == 2:
        return apply_rope(x, cos, sin)
    return x * cos[:, :, None].to(x.dtype) + rotate_half(x) * sin[:, :, None].to(x.dtype)


class Attention(nn.Module):
    """Grouped-query attention with rotary embeddings through SDPA."""

    def __init__(self, args: TransformerArgs):
        super().__init__()
        self.head_dim = args.head_dim
        self.wq = nn.Linear(args.dim, args.n_heads * self.head_dim, bias=False)
        self.wk = nn.Linear(args.dim, args.kv_heads * self.head_dim, bias=False)
        self.wv = nn.Linear(args.dim, args.kv_heads * self.head_dim, bias=False)
        self.wo = nn.Linear(args.n_heads * self.head_dim, args.dim, bias=False)
        self.q_norm = nn.RMSNorm(self.head_dim, eps=args.norm_eps) if args.qk_norm else None
        self.k_norm = nn.RMSNorm(self.head_dim, eps=args.norm_eps) if args.qk_norm else None

    def forward(
        self,
        x: torch.Tensor,
        cos: torch.Tensor,
        sin: torch.Tensor,
        attn_mask: torch.Tensor | None = None,
        cache: KVCache | None = None,
        layer_id: int = 0,
    ) -> torch.Tensor:
        batch, seq, _ = x.shape
        # -1 heads: under tensor parallelism each rank holds only its share of the heads.
        q = self.wq(x).view(batch, seq, -1, self.head_dim)
        k = self.wk(x).view(batch, seq, -1, self.head_dim)
        v = self.wv(x).view(batch, seq, -1, self.head_dim)
        if self.q_norm is not None:
            q, k = self.q_norm(q), self.k_norm(k)
        q, k = _rotate(q, cos, sin), _rotate(k, cos, sin)
        q, k, v = (t.transpose(1, 2) for t in (q, k, v))
        if cache is not None:
            k, v = cache.update(layer_id, k, v)
        gqa = q.shape[1] != k.shape[1]
        if attn_mask is None:
            out = F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=gqa)
        else:
            out = F.scaled_dot_product_attention(q, k, v, attn_mask=attn_mask, enable_gqa=gqa)
        return self.wo(out.transpose(1, 2).reshape(batch, seq, -1))

    def init_weights(self, std: float, out_std: float) -> None:
        for linear in (self.wq, self.wk, self.wv):
            nn.init.trunc_normal_(linear.weight, std=std, a=-3 * std, b=3 * std)
        nn.init.trunc_normal_(self.wo.weight, std=out_std, a=-3 * out_std, b=3 * out_std)
        for norm in (self.q_norm, self.k_norm):
            if norm is not None:
                norm.reset_parameters()


class FeedForward(nn.Module):
    """SwiGLU MLP: w2(silu(w1 x) * w3 x)."""

    def __init__(self, dim: int, hidden_dim: int):
        super().__init__()
        self.w1 = nn.Linear(dim, hidden_dim, bias=False)
        self.w2 = nn.Linear(hidden_dim, dim, bias=False)
        self.w3 = nn.Linear(dim, hidden_dim, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.w2(F.silu(self.w1(x)) * self.w3(x))

    def init_weights(self, std: float, out_std: float) -> None:
        nn.init.trunc_normal_(self.w1.weight, std=std, a=-3 * std, b=3 * std)
        nn.init.trunc_normal_(self.w3.weight, std=std, a=-3 * std, b=3 * std)
        nn.init.trunc_normal_(self.w2.weight, std=out_std, a=-3 * out_std, b=3 * out_std)


class TransformerBlock(nn.Module):
    """Pre-norm block: x + attn(norm(x)), then x + mlp(norm(x))."""

    def __init__(self, layer_id: int, args: TransformerArgs):
        super().__init__()
        self.layer_id = layer_id
        self.attention_norm = nn.RMSNorm(args.dim, eps=args.norm_eps)
        self.attention = Attention(args)
        self.ffn_norm = nn.RMSNorm(args.dim, eps=args.norm_eps)
        moe = args.moe
        if moe is not None and (layer_id + 1) % moe.every == 0:
            from forge.model.moe import MoE

            self.feed_forward: nn.Module = MoE(args.dim, moe.expert_ffn_dim or args.hidden_dim, moe)
        else:
            self.feed_forward = FeedForward(args.dim, args.hidden_dim)

    def forward(
        self,
        x: torch.Tensor,
        cos: torch.Tensor,
        sin: torch.Tensor,
        attn_mask: torch.Tensor | None = None,
        cache: KVCache | None = None,
    ) -> torch.Tensor:
        # cache and layer_id by keyword: the tensor-parallel plan lays out the four positional inputs.
        x = x + self.attention(self.attention_norm(x), cos, sin, attn_mask, cache=cache, layer_id=self.layer_id)
        return x + self.feed_forward(self.ffn_norm(x))

    def init_weights(self, std: float, out_std: float) -> None:
        self.attention_norm.reset_parameters()
        self.ffn_norm.reset_parameters()
        self.attention.init_weights(std, out_std)
        self.feed_forward.init_weights(std, out_std)


class Transformer(nn.Module):
    """Token embedding, N blocks, final norm, output head. Any end piece may be None on a pipeline stage."""

    def __init__(self, args: TransformerArgs):
        super().__init__()
        self.args = args
        self.tok_embeddings: nn.Embedding | None = nn.Embedding(args.vocab_size, args.dim)
        self.layers = nn.ModuleDict({str(i): TransformerBlock(i, args) for i in range(args.n_layers)})
        self.norm: nn.RMSNorm | None = nn.RMSNorm(args.dim, eps=args.norm_eps)
        self.output: nn.Linear | None = nn.Linear(args.dim, args.vocab_size, bias=False)
        self.tie_weights()
        cos, sin = rope_tables(args.head_dim, args.max_seq_len, args.rope_theta, args.rope_scaling)
        self.register_buffer("rope_cos", cos, persistent=False)
        self.register_buffer("rope_sin", sin, persistent=False)

    def tie_weights(self) -> bool:
        """Make the output head use the embedding matrix when args.tie_embeddings (and this part holds both);
        call again after anything that re-creates parameters (to_empty, a tensor-parallel split)."""
        tied = self.args.tie_embeddings and self.output is not None and self.tok_embeddings is not None
        if tied:
            self.output.weight = self.tok_embeddings.weight
        return tied

    def init_parts(self) -> list[tuple[str, nn.Module]]:
        """The units of initialisation, by plain name: embedding, each block, final norm, head (those this part
        of the model holds; a tied head is the embedding's and no unit of its own)."""
        parts: list[tuple[str, nn.Module]] = []
        if self.tok_embeddings is not None:
            parts.append(("tok_embeddings", self.tok_embeddings))
        parts += [(f"layers.{key}", block) for key, block in self.layers.items()]
        if self.norm is not None:
            parts.append(("norm", self.norm))
        if self.output is not None and not self.args.tie_embeddings:
            parts.append(("output", self.output))
        return parts

    def init_part(self, name: str, module: nn.Module) -> None:
        """Initialise one unit of `init_parts` in place (`module` may be a standalone copy of it)."""
        args = self.args
        std = args.init_std
        if name == "tok_embeddings":
            nn.init.normal_(module.weight, std=std)
        elif name.startswith("layers."):
            module.init_weights(std, std / math.sqrt(2 * args.n_layers) if args.depth_init else std)
        elif name == "norm":
            module.reset_parameters()
        elif name == "output":
            head_std = args.dim**-0.5
            nn.init.trunc_normal_(module.weight, std=head_std, a=-3 * head_std, b=3 * head_std)
        else:
            raise ValueError(f"no init unit named {name!r}")

    def init_buffers(self) -> None:
        args = self.args
        cos, sin = rope_tables(args.head_dim, args.max_seq_len, args.rope_theta, args.rope_scaling)
        with torch.no_grad():
            self.rope_cos.copy_(cos)
            self.rope_sin.copy_(sin)

    def init_weights(self, seed: int | None = None) -> None:
        """(Re)initialise every parameter and buffer in place; call after `to_empty` from the meta device.

        With `seed`, each unit draws from its own generator seeded by (seed, its plain name), so a unit gets the
        same values whether the whole model, one pipeline stage or a copy of that unit alone is initialised (how a
        sharded model is filled one unit at a time). Without, the units draw in turn from the global generator.
        """
        self.init_buffers()
        for name, part in self.init_parts():
            if seed is None:
                self.init_part(name, part)
                continue
            with torch.random.fork_rng(devices=[]):
                torch.manual_seed(unit_seed(seed, name))
                self.init_part(name, part)
        self.tie_weights()  # to_empty() re-created the shared matrix once per module: tie again

    def forward(
        self,
        tokens: torch.Tensor,
        attn_mask: torch.Tensor | None = None,
        cache: KVCache | None = None,
        positions: torch.Tensor | None = None,
        head: bool = True,
    ) -> torch.Tensor:
        """tokens (batch, seq) ids -> logits (batch, seq, vocab); hidden states on a stage without a head.

        attn_mask: optional boolean (batch, 1, seq, seq), True where attention is allowed (already causal); with a
        cache it spans (batch, 1, seq, cached + seq).
        cache: a KVCache to read past keys/values from and append these positions to (incremental decoding).
        positions: optional (batch, seq) rotary positions; default cache.length + 0..seq-1 (0.. without a cache).
        head: False returns the final-norm hidden states instead of logits (a chunked loss applies the head).
        """
        h = self.tok_embeddings(tokens) if self.tok_embeddings is not None else tokens
        seq = h.shape[1]
        if positions is None and cache is None:
            cos, sin = self.rope_cos[:seq], self.rope_sin[:seq]
        else:
            if positions is None:
                positions = torch.arange(cache.length, cache.length + seq, device=h.device)[None]
            cos, sin = self.rope_cos[positions], self.rope_sin[positions]
            if attn_mask is None and cache is not None:  # causal, aligned to the end of the cached keys
                past = cache.length
                keys = torch.arange(past + seq, device=h.device)
                attn_mask = (keys[None, :] <= past + torch.arange(seq, device=h.device)[:, None])[None, None]
        for block in self.layers.values():
            h = block(h, cos, sin, attn_mask, cache)
        if self.norm is not None:
            h = self.norm(h)
        return self.output(h) if self.output is not None and head else h


def build_transformer(args: TransformerArgs, device: str | torch.device = "cpu", seed: int = 0) -> Transformer:
    """Build on the meta device, materialise on `device` and initialise with `seed`."""
    with torch.device("meta"):
        model = Transformer(args)
    model.to_empty(device=device)
    model.init_weights(seed=seed)
    return model


def unit_seed(seed: int, name: str) -> int:
    """The seed of one initialisation unit: stable across processes and Python runs (no hash randomisation)."""
    return (seed * 0x9E3779B1 + zlib.crc32(name.encode())) % 2**63
