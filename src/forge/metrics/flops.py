"""Model FLOPs per token of the Llama-style decoder (dense or MoE), counted from its arguments.

Only matmuls are counted (2 FLOPs per multiply-add); norms, RoPE, softmax, SiLU and the embedding lookup are
left out, as in PaLM's MFU. Attention counts the full seq_len x seq_len score and value products (no causal
halving), which is what SDPA's FLOP formula and torchtitan count. A training step is 3x the forward: the
backward computes the gradients of both the inputs and the weights of every matmul.

A routed MoE layer counts its router gate, top_k routed experts and the shared experts per token. In a dropless
layer (capacity_factor 0) every token is computed by exactly top_k experts, so this count is exact whatever the
routing; with a capacity limit it is an upper bound (dropped assignments cost nothing).
"""

from dataclasses import dataclass

from torch import nn

from forge.models.llama.args import TransformerArgs


@dataclass
class FlopsPerToken:
    """Forward FLOPs per token, by part of the model."""

    attention_projections: float
    """wq, wk, wv (GQA: kv_heads wide) and wo over all blocks (MLA: its low-rank q and kv projections and wo)."""
    attention_scores: float
    """QK^T and softmax(QK^T)V over all blocks; grows with seq_len."""
    mlp: float
    """Dense SwiGLU MLPs of the non-MoE blocks."""
    moe: float
    """Router gates, top_k routed experts and shared experts of the MoE blocks."""
    head: float
    """The output projection onto the vocabulary."""

    @property
    def forward(self) -> float:
        return self.attention_projections + self.attention_scores + self.mlp + self.moe + self.head

    @property
    def training(self) -> float:
        """Forward plus backward (twice the forward)."""
        return 3 * self.forward


def swiglu_flops(dim: int, hidden: int) -> float:
    """w1, w3 (dim -> hidden) and w2 (hidden -> dim)."""
    return 2 * 3 * dim * hidden


def is_moe_block(args: TransformerArgs, layer_id: int) -> bool:
    return args.moe is not None and args.moe.in_block(layer_id)


def attention_flops(args: TransformerArgs, seq_len: int) -> tuple[float, float]:
    """(projections, scores) forward FLOPs per token of one attention layer."""
    heads = args.n_heads
    if args.attention_kind == "mla":
        m = args.mla
        qk = m.qk_nope_head_dim + m.qk_rope_head_dim
        q = args.dim * m.q_lora_rank + m.q_lora_rank * heads * qk if m.q_lora_rank else args.dim * heads * qk
        kv_a = args.dim * (m.kv_lora_rank + m.qk_rope_head_dim)
        kv = kv_a + m.kv_lora_rank * heads * (m.qk_nope_head_dim + m.v_head_dim)
        out = heads * m.v_head_dim * args.dim
        return 2 * (q + kv + out), 2 * heads * (qk + m.v_head_dim) * seq_len
    q_width, kv_width = heads * args.head_size, args.kv_heads * args.head_size
    return 2 * args.dim * (2 * q_width + 2 * kv_width), 2 * 2 * q_width * seq_len


def count_flops_per_token(args: TransformerArgs, seq_len: int) -> FlopsPerToken:
    """Forward FLOPs per token of a model built from `args`, on sequences of seq_len tokens."""
    projections, scores = attention_flops(args, seq_len)
    moe_blocks = sum(is_moe_block(args, i) for i in range(args.n_layers))
    dense_blocks = args.n_layers - moe_blocks
    moe_per_block = 0.0
    if args.moe is not None:
        moe = args.moe
        expert_hidden = moe.expert_ffn_dim or args.hidden_dim
        moe_per_block = (
            2 * args.dim * moe.num_experts
            + moe.top_k * swiglu_flops(args.dim, expert_hidden)
            + swiglu_flops(args.dim, expert_hidden * moe.num_shared_experts)
        )
    return FlopsPerToken(
        attention_projections=args.n_layers * projections,
        attention_scores=args.n_layers * scores,
        mlp=dense_blocks * swiglu_flops(args.dim, args.hidden_dim),
        moe=moe_blocks * moe_per_block,
        head=2 * args.dim * args.vocab_size,
    )


def model_args(model: nn.Module) -> TransformerArgs | None:
    """The decoder's arguments of a model (or of a wrapper holding one as `.model`/`.decoder`), else None."""
    for candidate in (model, getattr(model, "decoder", None), getattr(model, "model", None)):
        args = getattr(candidate, "args", None)
        if isinstance(args, TransformerArgs):
            return args
    return None


def training_flops_per_token(model: nn.Module, seq_len: int) -> float | None:
    """Training FLOPs per token of the whole model (all shards and stages), or None for an unknown model."""
    args = model_args(model)
    return None if args is None else count_flops_per_token(args, seq_len).training
