"""Arguments of the Llama-style decoder. Plain dataclasses: the config schema extends them."""

from dataclasses import dataclass, field
from enum import StrEnum
from typing import Any, Optional

from forge.domain import domain
from forge.models.common.moe.args import AuxLossScope, MoEArgs, RouterKind

__all__ = ["AuxLossScope", "MLAArgs", "MoEArgs", "RopeScalingArgs", "RouterKind", "TransformerArgs"]


@dataclass
class RopeScalingArgs:
    """Llama-3 style frequency-dependent RoPE scaling for long context."""

    factor: float = domain(8.0, gt=0)
    """How much longer the target context is than the original one."""
    low_freq_factor: float = domain(1.0, gt=0)
    """Wavelengths longer than original_max_seq_len / low_freq_factor are divided by `factor`."""
    high_freq_factor: float = domain(4.0, gt=0)
    """Wavelengths shorter than original_max_seq_len / high_freq_factor are kept."""
    original_max_seq_len: int = domain(8192, ge=1)
    """Context length the base model was trained with."""


class AttentionBackend(StrEnum):
    """TransformerArgs.attention's choices (forge.models.common.attention runs them)."""

    sdpa = "sdpa"
    flex = "flex"


class AttentionKind(StrEnum):
    """TransformerArgs.attention_kind's choices: grouped-query attention, or DeepSeek's multi-head latent attention."""

    gqa = "gqa"
    mla = "mla"


@dataclass
class MLAArgs:
    """Multi-head latent attention (DeepSeek-V2 / V3; forge.models.llama.latent_attention), used under
    attention_kind=mla. The defaults are DeepSeek-V3's."""

    q_lora_rank: int = domain(1536, ge=0, means="0: one full wq")
    """Rank of the query's low-rank pair (wq_a, normed, then wq_b); 0 projects queries with one full wq."""
    kv_lora_rank: int = domain(512, ge=1)
    """Width of the per-token latent that keys and values are expanded from."""
    qk_nope_head_dim: int = domain(128, ge=1)
    """Per head: the query / key width without RoPE."""
    qk_rope_head_dim: int = domain(64, ge=2)
    """Per head: the query's rotary width; the rotary key of this width is shared by all heads."""
    v_head_dim: int = domain(128, ge=1)
    """Per head: the value width (wo maps n_heads x v_head_dim back to dim)."""


@dataclass
class TransformerArgs:
    """Shape and initialisation of a Llama-style decoder."""

    dim: int = domain(256, ge=1)
    """Width of the residual stream."""
    n_layers: int = domain(4, ge=1)
    """Number of transformer blocks."""
    n_heads: int = domain(8, ge=1)
    """Query heads; dim must be divisible by n_heads unless head_dim is set."""
    n_kv_heads: Optional[int] = domain(None, ge=1)
    """Key/value heads (None = n_heads: MHA; 1: MQA; otherwise GQA). Must divide n_heads."""
    head_dim: Optional[int] = domain(None, ge=2)
    """Width of one attention head; None = dim // n_heads. Qwen3 sets it apart from the width (0.6B: dim 1024, 16
    heads of 128), so q/k/v project to n_heads x head_dim and wo back to dim."""
    vocab_size: int = domain(8192, ge=1)
    """Rows of the embedding and the output head."""
    ffn_dim: Optional[int] = domain(None, ge=1)
    """Explicit SwiGLU hidden size; None derives it from dim, ffn_dim_multiplier and multiple_of."""
    ffn_dim_multiplier: Optional[float] = domain(None, gt=0)
    """Scales the derived hidden size (Llama 3 uses 1.3 for 8B)."""
    multiple_of: int = domain(256, ge=1)
    """The derived hidden size is rounded up to a multiple of this."""
    norm_eps: float = domain(1e-5, gt=0)
    """Epsilon of RMSNorm."""
    rope_theta: float = domain(10000.0, gt=0)
    """Base of the rotary frequencies."""
    rope_scaling: Optional[RopeScalingArgs] = None
    """None, or Llama-3 style scaling of the rotary frequencies."""
    max_seq_len: int = domain(2048, ge=1)
    """Longest sequence the rotary tables cover."""
    qk_norm: bool = False
    """RMSNorm on queries and keys per head before RoPE."""
    tie_embeddings: bool = False
    """Share the output head's weight with the token embedding."""
    init_std: float = domain(0.02, gt=0)
    """Std of the normal init of linear and embedding weights."""
    depth_init: bool = True
    """Scale the std of output projections (wo, w2) by 1/sqrt(2 * n_layers)."""
    moe: Optional[MoEArgs] = None
    """None for a dense model, else the mixture-of-experts settings."""
    attention: AttentionBackend = AttentionBackend.sdpa
    """Attention kernel: sdpa (dense boolean masks for documents and windows) or flex (FlexAttention over a block
    sparse BlockMask, compiled: no (seq, seq) mask, masked-out blocks skipped). torch 2.13 has no flex backward on
    CPU: training there runs flex's unfused reference (slow, (seq, seq) scores per head); CPU evaluation and CUDA
    run the compiled kernel. Generation with a KV cache runs SDPA either way; VLMs take sdpa only."""
    attention_kind: AttentionKind = AttentionKind.gqa
    """gqa: grouped-query attention (n_heads, n_kv_heads, head_dim); mla: multi-head latent attention with the
    widths of `mla` (DeepSeek-V2 / V3; n_kv_heads and head_dim then do not apply)."""
    mla: MLAArgs = field(default_factory=MLAArgs)
    """Widths of multi-head latent attention, read under attention_kind=mla."""
    sliding_window: Any = domain(None)
    """None: full causal attention. An int w: each query attends to at most w keys, itself and the w - 1 before it
    (Mistral). A list is cycled over the layers, layer i taking entry i % len, null meaning full: [4096, null]
    alternates sliding and full layers (gpt-oss, Gemma 2), five 1024s and a null is Gemma 3's 5:1."""

    @property
    def head_size(self) -> int:
        """The width of one attention head the model is built with: head_dim, or dim // n_heads when unset."""
        return self.head_dim or self.dim // self.n_heads

    @property
    def rope_dim(self) -> int:
        """Width RoPE rotates: the head under gqa, the rotary part (qk_rope_head_dim) under mla."""
        return self.mla.qk_rope_head_dim if self.attention_kind == "mla" else self.head_size

    @property
    def kv_width(self) -> int:
        """Elements per token of one layer's keys plus values as attention reads them (MLA: expanded per head)."""
        if self.attention_kind == "mla":
            m = self.mla
            return self.n_heads * (m.qk_nope_head_dim + m.qk_rope_head_dim + m.v_head_dim)
        return 2 * self.kv_heads * self.head_size

    @property
    def kv_heads(self) -> int:
        return self.n_kv_heads or self.n_heads

    @property
    def hidden_dim(self) -> int:
        if self.ffn_dim:
            return self.ffn_dim
        hidden = int(2 * 4 * self.dim / 3)
        if self.ffn_dim_multiplier is not None:
            hidden = int(self.ffn_dim_multiplier * hidden)
        return self.multiple_of * ((hidden + self.multiple_of - 1) // self.multiple_of)

    def __post_init__(self) -> None:
        # Choices held as plain strings whichever way the args were made (a config's Enum members, the defaults):
        # an HF config.json, a safe YAML file and a weights_only torch.load all take them.
        self.attention, self.attention_kind = str(self.attention), str(self.attention_kind)
        if isinstance(self.rope_scaling, dict):
            self.rope_scaling = RopeScalingArgs(**self.rope_scaling)
        if isinstance(self.moe, dict):
            self.moe = MoEArgs(**self.moe)
        if isinstance(self.mla, dict):
            self.mla = MLAArgs(**self.mla)
