"""GPT-2 in plain PyTorch, parameter for parameter transformers' GPT2LMHeadModel (forge.models.gpt2.hf maps names).

The projections keep GPT-2's Conv1D layout, (in, out) applied as x @ W + b, so every weight is its checkpoint's
tensor; the attention's fused c_attn weight is stored (dim, 3, dim), q, k and v on dim 1, so that tensor
parallelism splits its heads (dim 2) with one plain Shard placement (forge.models.gpt2.parallelize). Attention
reshapes with -1 heads: a rank holding some heads runs the same code. No dropout: pretraining-style runs use none.
"""

import math
from collections.abc import Callable

import torch
import torch.nn.functional as F
from torch import nn

from forge.models.common.attention import DocumentMask, Mask, attend, layer_masks, visible_keys
from forge.models.common.init_spec import ONES, ZEROS, InitSpec, apply_specs, fill_whole_, prefixed
from forge.models.common.kv_cache import KVCache, token_positions
from forge.models.gpt2.args import GPT2Args


class Conv1D(nn.Module):
    """x @ weight + bias with the weight stored (in, *out): GPT-2's Conv1D, its output features possibly in parts
    (c_attn's (3, dim))."""

    def __init__(self, in_features: int, out_shape: tuple[int, ...]):
        super().__init__()
        self.weight = nn.Parameter(torch.empty(in_features, *out_shape))
        self.bias = nn.Parameter(torch.empty(out_shape))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x @ self.weight.flatten(1) + self.bias.flatten()

    def init_specs(self, std: float) -> dict[str, InitSpec]:
        return {"weight": InitSpec("normal", std), "bias": ZEROS}


class Attention(nn.Module):
    """Causal multi-head self-attention through SDPA (scaled by 1 / sqrt(head_dim), as GPT-2)."""

    def __init__(self, args: GPT2Args):
        super().__init__()
        self.head_dim = args.head_size
        self.c_attn = Conv1D(args.dim, (3, args.dim))
        self.c_proj = Conv1D(args.dim, (args.dim,))
        # (batch, heads, part, head_dim) -> the whole sequence's, set by context parallelism
        self.gather_kv: Callable[[torch.Tensor], torch.Tensor] | None = None

    def forward(
        self, x: torch.Tensor, attn_mask: Mask = None, cache: KVCache | None = None, layer_id: int = 0
    ) -> torch.Tensor:
        batch, seq, _ = x.shape
        qkv = self.c_attn(x).view(batch, seq, 3, -1, self.head_dim)
        q, k, v = qkv.permute(2, 0, 3, 1, 4).unbind(0)  # each (batch, heads, seq, head_dim)
        k, v = visible_keys(k, v, cache, layer_id, self.gather_kv)
        out = attend(q, k, v, attn_mask)
        return self.c_proj(out.transpose(1, 2).reshape(batch, seq, -1))

    def init_specs(self, std: float, out_std: float) -> dict[str, InitSpec]:
        return prefixed("c_attn", self.c_attn.init_specs(std)) | prefixed("c_proj", self.c_proj.init_specs(out_std))


class MLP(nn.Module):
    """dim -> hidden, GELU (tanh approximation: HF's gelu_new), hidden -> dim."""

    def __init__(self, args: GPT2Args):
        super().__init__()
        self.c_fc = Conv1D(args.dim, (args.hidden_dim,))
        self.c_proj = Conv1D(args.hidden_dim, (args.dim,))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.c_proj(F.gelu(self.c_fc(x), approximate="tanh"))

    def init_specs(self, std: float, out_std: float) -> dict[str, InitSpec]:
        return prefixed("c_fc", self.c_fc.init_specs(std)) | prefixed("c_proj", self.c_proj.init_specs(out_std))


def layer_norm_specs(name: str) -> dict[str, InitSpec]:
    return {f"{name}.weight": ONES, f"{name}.bias": ZEROS}


class Block(nn.Module):
    """Pre-norm block: x + attn(ln_1(x)), then x + mlp(ln_2(x))."""

    def __init__(self, layer_id: int, args: GPT2Args):
        super().__init__()
        self.layer_id = layer_id
        self.ln_1 = nn.LayerNorm(args.dim, eps=args.norm_eps)
        self.attn = Attention(args)
        self.ln_2 = nn.LayerNorm(args.dim, eps=args.norm_eps)
        self.mlp = MLP(args)

    def forward(self, x: torch.Tensor, attn_mask: Mask = None, cache: KVCache | None = None) -> torch.Tensor:
        x = x + self.attn(self.ln_1(x), attn_mask, cache, self.layer_id)
        return x + self.mlp(self.ln_2(x))

    def init_specs(self, std: float, out_std: float) -> dict[str, InitSpec]:
        return (
            layer_norm_specs("ln_1")
            | prefixed("attn", self.attn.init_specs(std, out_std))
            | layer_norm_specs("ln_2")
            | prefixed("mlp", self.mlp.init_specs(std, out_std))
        )


class GPT2(nn.Module):
    """Token and position embeddings, N blocks, final LayerNorm, output head (tied to the token embedding)."""

    def __init__(self, args: GPT2Args):
        super().__init__()
        self.args = args
        self.tok_embeddings = nn.Embedding(args.vocab_size, args.dim)
        self.pos_embeddings = nn.Embedding(args.max_seq_len, args.dim)
        self.layers = nn.ModuleDict({str(i): Block(i, args) for i in range(args.n_layers)})
        self.norm = nn.LayerNorm(args.dim, eps=args.norm_eps)
        self.output = nn.Linear(args.dim, args.vocab_size, bias=False)
        self.tie_weights()

    def tie_weights(self) -> bool:
        """Make the head use the embedding matrix when args.tie_embeddings; call again after anything that
        re-creates parameters (to_empty, a tensor-parallel split)."""
        if self.args.tie_embeddings:
            self.output.weight = self.tok_embeddings.weight
        return self.args.tie_embeddings

    def init_specs(self) -> dict[str, InitSpec]:
        """How each parameter starts, by plain name (forge.models.common.init_spec): normal weights, the
        projections into the residual stream (c_proj) scaled by 1 / sqrt(2 * n_layers), zero biases, LayerNorms
        ones and zeros."""
        args = self.args
        std = args.init_std
        out_std = std / math.sqrt(2 * args.n_layers)
        specs = {"tok_embeddings.weight": InitSpec("normal", std), "pos_embeddings.weight": InitSpec("normal", std)}
        for key, block in self.layers.items():
            specs |= prefixed(f"layers.{key}", block.init_specs(std, out_std))
        specs |= layer_norm_specs("norm")
        if not args.tie_embeddings:
            specs["output.weight"] = InitSpec("normal", std)
        return specs

    def init_buffers(self) -> None:
        """GPT-2 has no buffers: nothing to compute."""

    def init_weights(self, seed: int | None = None) -> None:
        """(Re)initialise every parameter in place; call after `to_empty` from the meta device. With `seed`, each
        value is a function of (seed, name, row block), as forge.parallel.init fills shards; without, the
        parameters draw in turn from the global generator."""
        self.tie_weights()  # to_empty() re-created the shared matrix once per module: tie again
        specs = self.init_specs()
        if seed is None:
            apply_specs(self, specs)
            return
        for name, tensor in self.named_parameters():
            if name not in specs:
                raise KeyError(f"no init spec for parameter {name!r}")
            fill_whole_(tensor, specs[name], seed, name)

    def forward(
        self,
        tokens: torch.Tensor,
        attn_mask: torch.Tensor | DocumentMask | None = None,
        cache: KVCache | None = None,
        positions: torch.Tensor | None = None,
        head: bool = True,
    ) -> torch.Tensor:
        """tokens (batch, seq) ids -> logits (batch, seq, vocab).

        attn_mask: None (causal), a boolean (batch, 1, seq, seq) mask, True where attention is allowed (already
        causal; with a cache it spans (batch, 1, seq, cached + seq)), or the DocumentMask of packed samples (each
        document attends within itself; positions still count from the start of the sequence, as GPT-2 trained on
        packed text). A DocumentMask with `queries` says which positions of the whole sequences `tokens` are
        (context parallelism).
        cache: a KVCache to read past keys/values from and append these positions to (incremental decoding).
        positions: optional (batch, seq) positions; default cache.length + 0..seq-1 (0.. without a cache).
        head: False returns the final-norm hidden states instead of logits (a chunked loss applies the head).
        """
        batch, seq = tokens.shape
        positions, attn_mask = token_positions(attn_mask, cache, positions, seq, tokens.device)
        if positions is None:
            positions = torch.arange(seq, device=tokens.device)[None]
        h = self.tok_embeddings(tokens) + self.pos_embeddings(positions)
        mask = layer_masks(attn_mask, [None], False, batch, seq, tokens.device)[None]
        for block in self.layers.values():
            h = block(h, mask, cache)
        h = self.norm(h)
        return self.output(h) if head else h
