"""A Llama-style decoder in plain PyTorch.

Blocks live in an `nn.ModuleDict` keyed "0".."N-1" so parameter names survive a pipeline split, and the
embedding, final norm and output head may be None on a stage that holds only a slice of the model.
"""

import math
from collections.abc import Callable

import torch
from torch import nn

from forge.models.common.attention import DocumentMask, Mask, attend, layer_masks, layer_window, visible_keys
from forge.models.common.feed_forward import FeedForward
from forge.models.common.init_spec import ONES, InitSpec, apply_specs, fill_piece_, prefixed, trunc_normal
from forge.models.common.kv_cache import KVCache, token_positions
from forge.models.common.moe import MoE
from forge.models.common.moe.experts import GroupedExperts
from forge.models.common.rope import apply_rope, rope_tables
from forge.models.llama.args import TransformerArgs
from forge.models.llama.latent_attention import LatentAttention


class Attention(nn.Module):
    """Grouped-query attention with rotary embeddings, through SDPA or FlexAttention (forge.models.common.attention)."""

    def __init__(self, args: TransformerArgs):
        super().__init__()
        self.head_dim = args.head_size
        self.wq = nn.Linear(args.dim, args.n_heads * self.head_dim, bias=False)
        self.wk = nn.Linear(args.dim, args.kv_heads * self.head_dim, bias=False)
        self.wv = nn.Linear(args.dim, args.kv_heads * self.head_dim, bias=False)
        self.wo = nn.Linear(args.n_heads * self.head_dim, args.dim, bias=False)
        self.q_norm = nn.RMSNorm(self.head_dim, eps=args.norm_eps) if args.qk_norm else None
        self.k_norm = nn.RMSNorm(self.head_dim, eps=args.norm_eps) if args.qk_norm else None
        # (batch, heads, part, head_dim) -> the whole sequence's: set when each rank holds part of every sequence
        # (forge.parallel.context_parallel); the mask's keys say which positions the gathered rows are.
        self.gather_kv: Callable[[torch.Tensor], torch.Tensor] | None = None

    def forward(
        self,
        x: torch.Tensor,
        cos: torch.Tensor,
        sin: torch.Tensor,
        attn_mask: Mask = None,
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
        q, k = apply_rope(q, cos, sin), apply_rope(k, cos, sin)
        q, k, v = (t.transpose(1, 2) for t in (q, k, v))
        k, v = visible_keys(k, v, cache, layer_id, self.gather_kv)
        out = attend(q, k, v, attn_mask)
        return self.wo(out.transpose(1, 2).reshape(batch, seq, -1))

    def init_specs(self, std: float, out_std: float) -> dict[str, InitSpec]:
        specs = {f"{name}.weight": trunc_normal(std) for name in ("wq", "wk", "wv")}
        specs["wo.weight"] = trunc_normal(out_std)
        if self.q_norm is not None:
            specs |= {"q_norm.weight": ONES, "k_norm.weight": ONES}
        return specs

    def init_weights(self, std: float, out_std: float) -> None:
        apply_specs(self, self.init_specs(std, out_std))


class TransformerBlock(nn.Module):
    """Pre-norm block: x + attn(norm(x)), then x + mlp(norm(x))."""

    def __init__(self, layer_id: int, args: TransformerArgs):
        super().__init__()
        self.layer_id = layer_id
        self.attention_norm = nn.RMSNorm(args.dim, eps=args.norm_eps)
        self.attention = LatentAttention(args) if args.attention_kind == "mla" else Attention(args)
        self.ffn_norm = nn.RMSNorm(args.dim, eps=args.norm_eps)
        moe = args.moe
        if moe is not None and moe.in_block(layer_id):
            self.feed_forward: nn.Module = MoE(args.dim, moe.expert_ffn_dim or args.hidden_dim, moe)
        else:
            self.feed_forward = FeedForward(args.dim, args.hidden_dim)

    def forward(
        self,
        x: torch.Tensor,
        cos: torch.Tensor,
        sin: torch.Tensor,
        attn_mask: Mask = None,
        cache: KVCache | None = None,
    ) -> torch.Tensor:
        # cache and layer_id by keyword: the tensor-parallel plan lays out the four positional inputs.
        x = x + self.attention(self.attention_norm(x), cos, sin, attn_mask, cache=cache, layer_id=self.layer_id)
        return x + self.feed_forward(self.ffn_norm(x))

    def init_specs(self, std: float, out_std: float) -> dict[str, InitSpec]:
        return (
            {"attention_norm.weight": ONES, "ffn_norm.weight": ONES}
            | prefixed("attention", self.attention.init_specs(std, out_std))
            | prefixed("feed_forward", self.feed_forward.init_specs(std, out_std))
        )

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
        # False on a later pipeline stage that holds the tied embedding only as its head (its input is hidden states)
        self.embeds_tokens = True
        self.tie_weights()
        cos, sin = rope_tables(args.rope_dim, args.max_seq_len, args.rope_theta, args.rope_scaling)
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

    def block_stds(self) -> tuple[float, float]:
        """(std, out_std) of the blocks' weights; out_std, of the projections into the residual stream, shrinks
        with depth under args.depth_init."""
        args = self.args
        std = args.init_std
        return std, std / math.sqrt(2 * args.n_layers) if args.depth_init else std

    def init_specs(self) -> dict[str, InitSpec]:
        """How each parameter this part holds starts, by plain name (and the buffers initialisation sets, such as
        MoE router biases); see forge.models.common.init_spec."""
        args = self.args
        std, out_std = self.block_stds()
        specs: dict[str, InitSpec] = {}
        if self.tok_embeddings is not None:
            specs["tok_embeddings.weight"] = InitSpec("normal", args.init_std)
        for key, block in self.layers.items():
            specs |= prefixed(f"layers.{key}", block.init_specs(std, out_std))
        if self.norm is not None:
            specs["norm.weight"] = ONES
        if self.output is not None and not args.tie_embeddings:
            specs["output.weight"] = trunc_normal(args.dim**-0.5)
        return specs

    def init_part(self, name: str, module: nn.Module) -> None:
        """Initialise one unit of `init_parts` in place from the global generator."""
        if name.startswith("layers."):
            module.init_weights(*self.block_stds())
        elif name in ("tok_embeddings", "norm", "output"):
            apply_specs(module, {"weight": self.init_specs()[f"{name}.weight"]})
        else:
            raise ValueError(f"no init unit named {name!r}")

    def init_buffers(self) -> None:
        args = self.args
        cos, sin = rope_tables(args.rope_dim, args.max_seq_len, args.rope_theta, args.rope_scaling)
        with torch.no_grad():
            self.rope_cos.copy_(cos)
            self.rope_sin.copy_(sin)

    def init_weights(self, seed: int | None = None) -> None:
        """(Re)initialise every parameter and buffer in place; call after `to_empty` from the meta device.

        With `seed`, each value is a function of (seed, plain parameter name, row block)
        (forge.models.common.init_spec), so a parameter gets the same values whether the whole model, one pipeline
        stage, an expert slice or a shard of any parallel layout is filled (forge.parallel.init). Without, the units
        draw in turn from the global generator.
        """
        self.init_buffers()
        self.tie_weights()  # to_empty() re-created the shared matrix once per module: tie again
        if seed is None:
            for name, part in self.init_parts():
                self.init_part(name, part)
            return
        specs = self.init_specs()
        buffers = [(name, buf) for name, buf in self.named_buffers() if name in specs]
        for name, tensor in [*self.named_parameters(), *buffers]:
            if name not in specs:
                raise KeyError(f"no init spec for parameter {name!r}")
            fill_piece_(tensor, specs[name], seed, name, *self._whole_and_offset(name, tensor))

    def _whole_and_offset(self, name: str, tensor: torch.Tensor) -> tuple[tuple[int, ...], tuple[int, ...]]:
        """The whole parameter's shape and where `tensor` starts in it: the tensor itself, except the plain expert
        slices of expert parallelism (GroupedExperts.keep_slice), which start at expert `first`."""
        owner = self.get_submodule(name.rpartition(".")[0])
        rest = tuple(tensor.shape[1:])
        if isinstance(owner, GroupedExperts):
            return (owner.num_experts, *rest), (owner.first, *(0,) * len(rest))
        return tuple(tensor.shape), (0,) * tensor.dim()

    def forward(
        self,
        tokens: torch.Tensor,
        attn_mask: torch.Tensor | DocumentMask | None = None,
        cache: KVCache | None = None,
        positions: torch.Tensor | None = None,
        head: bool = True,
    ) -> torch.Tensor:
        """tokens (batch, seq) ids -> logits (batch, seq, vocab); hidden states on a stage without a head.

        attn_mask: optional boolean (batch, 1, seq, seq), True where attention is allowed (already causal); with a
        cache it spans (batch, 1, seq, cached + seq). Or the DocumentMask of packed samples, from which each layer's
        mask is built for args.attention and the layer's sliding window (forge.models.common.attention); one with
        `queries` says which positions of the whole sequences `tokens` are (context parallelism), and sets their
        positions.
        cache: a KVCache to read past keys/values from and append these positions to (incremental decoding).
        positions: optional (batch, seq) rotary positions; default cache.length + 0..seq-1 (0.. without a cache).
        head: False returns the final-norm hidden states instead of logits (a chunked loss applies the head).
        """
        h = self.tok_embeddings(tokens) if self.tok_embeddings is not None and self.embeds_tokens else tokens
        seq = h.shape[1]
        positions, attn_mask = token_positions(attn_mask, cache, positions, seq, h.device)
        if positions is None:
            cos, sin = self.rope_cos[:seq], self.rope_sin[:seq]
        else:
            cos, sin = self.rope_cos[positions], self.rope_sin[positions]
        windows = {key: layer_window(self.args.sliding_window, int(key)) for key in self.layers}
        flex = self.args.attention == "flex"
        masks = layer_masks(attn_mask, windows.values(), flex, h.shape[0], seq, h.device)
        for key, block in self.layers.items():
            h = block(h, cos, sin, masks[windows[key]], cache)
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
