"""Arguments of GPT-2. A plain dataclass: conf/model presets set `_target_` to it and its fields."""

from dataclasses import dataclass
from typing import Optional

from forge.domain import domain


@dataclass
class GPT2Args:
    """Shape and initialisation of a GPT-2 decoder (GPT-2 small: dim 768, 12 layers, 12 heads, 50257 tokens, 1024
    positions)."""

    dim: int = domain(768, ge=1)
    """Width of the residual stream (HF n_embd)."""
    n_layers: int = domain(12, ge=1)
    """Number of transformer blocks (HF n_layer)."""
    n_heads: int = domain(12, ge=1)
    """Attention heads; dim must be divisible by n_heads (HF n_head)."""
    vocab_size: int = domain(50257, ge=1)
    """Rows of the token embedding and the output head."""
    max_seq_len: int = domain(1024, ge=1)
    """Rows of the learned position embedding: the longest sequence the model reads (HF n_positions)."""
    ffn_dim: Optional[int] = domain(None, ge=1, means="null: 4 x dim")
    """Hidden width of the MLP; None is GPT-2's 4 x dim (HF n_inner)."""
    norm_eps: float = domain(1e-5, gt=0)
    """Epsilon of the LayerNorms (HF layer_norm_epsilon)."""
    tie_embeddings: bool = True
    """Share the output head's weight with the token embedding, as GPT-2 does."""
    attention: str = domain("sdpa", allowed=("sdpa",))
    """Attention kernel: SDPA (dense boolean masks for packed documents), the only one GPT-2 runs here."""
    init_std: float = domain(0.02, gt=0)
    """Std of the normal init of projection and embedding weights; the projections into the residual stream
    (c_proj) take init_std / sqrt(2 * n_layers), as GPT-2 does."""

    @property
    def hidden_dim(self) -> int:
        """The MLP's hidden width: ffn_dim, or 4 x dim when unset."""
        return self.ffn_dim or 4 * self.dim

    @property
    def head_size(self) -> int:
        """Width of one attention head."""
        return self.dim // self.n_heads
