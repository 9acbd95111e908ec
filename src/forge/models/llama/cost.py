"""The cost of the Llama-style decoder (dense, MoE, latent attention), counted from its arguments: what metrics,
`--plan` and the layout search read (forge.models.spec.ModelCost).

FLOPs: Only matmuls are counted (2 FLOPs per multiply-add); norms, RoPE, softmax, SiLU and the embedding lookup are
left out, as in PaLM's MFU. Attention counts the full seq_len x seq_len score and value products (no causal
halving), which is what SDPA's FLOP formula and torchtitan count. A training step is 3x the forward: the
backward computes the gradients of both the inputs and the weights of every matmul.

A routed MoE layer counts its router gate, top_k routed experts and the shared experts per token. In a dropless
layer (capacity_factor 0) every token is computed by exactly top_k experts, so this count is exact whatever the
routing; with a capacity limit it is an upper bound (dropped assignments cost nothing).

Activations: what autograd keeps per token and block, the terms forge.planning.memory's formula adds up.
"""

from typing import TYPE_CHECKING

from forge.models.llama.args import TransformerArgs
from forge.models.spec import FlopsPerToken

if TYPE_CHECKING:
    from forge.config.degrees import Degrees


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
            2 * args.dim * moe.num_experts  # the router
            + 2 * moe.top_k * args.dim  # the combine: each token's weighted sum, one batched product
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


def ffn_token_width(args) -> float:
    """Hidden width a token passes through in a block's MLP, averaged over the blocks (MoE: its k experts and the
    shared ones)."""
    moe = args.moe
    if moe is None:
        return args.hidden_dim
    expert = moe.expert_ffn_dim or args.hidden_dim
    moe_blocks = sum(moe.in_block(i) for i in range(args.n_layers))
    moe_width = expert * (moe.top_k + moe.num_shared_experts)
    return (moe_blocks * moe_width + (args.n_layers - moe_blocks) * args.hidden_dim) / args.n_layers


def block_activation_elems(args) -> float:
    """Elements autograd keeps per token for one block (see the module docstring)."""
    if args.attention_kind == "mla":
        return 4 * args.dim + mla_activation_elems(args) + 4 * ffn_token_width(args)
    q_width = args.n_heads * args.head_size  # dim unless model.head_dim sets the heads apart from the width
    return 4 * args.dim + 3 * q_width + 2 * args.kv_heads * args.head_size + 4 * ffn_token_width(args)


def moe_unsplit_bytes(args, act_bytes: int) -> float:
    """Per token, what an MoE layer keeps beyond its experts' hidden activations, averaged over the blocks: the k
    copies of the token in expert order (the grouped GEMMs' input, compute dtype), the k expert outputs in token order
    (the combine's fp32 input) and the router's logits, probabilities and scores (fp32, one per expert). Under tensor
    parallelism every rank routes the whole gathered sequence, so none of it is split."""
    moe = args.moe
    if moe is None:
        return 0.0
    moe_blocks = sum(moe.in_block(i) for i in range(args.n_layers))
    per_layer = moe.top_k * args.dim * (act_bytes + 4) + 3 * 4 * moe.num_experts
    return per_layer * moe_blocks / args.n_layers


def saved_kv_width(args) -> float:
    """Elements per token of one layer's keys and values as SDPA keeps them (MLA's values padded to the query
    width, forge.models.llama.latent_attention)."""
    if args.attention_kind != "mla":
        return args.kv_width
    m = args.mla
    qk = m.qk_nope_head_dim + m.qk_rope_head_dim
    return args.n_heads * (qk + max(qk, m.v_head_dim))


def mla_activation_elems(args) -> float:
    """Per token, what latent attention keeps past the norms' outputs: the q latent and its norm, the kv latent
    and its norm, SDPA's per-head queries, keys, values and output (the values and output padded to the query
    width when narrower, forge.models.llama.latent_attention) and the output fed to wo."""
    m, heads = args.mla, args.n_heads
    qk = m.qk_nope_head_dim + m.qk_rope_head_dim
    sdpa_value = max(qk, m.v_head_dim)
    return 2 * m.q_lora_rank + 2 * m.kv_lora_rank + heads * (2 * qk + 2 * sdpa_value + m.v_head_dim)


def block_gather_params(args, degrees: "Degrees") -> float:
    """Parameters of the largest block that FSDP all-gathers. An MoE block's
    expert weights are gathered only over (dp_shard / ep) x cp ranks, and only this rank's E / ep experts."""
    attention = attention_flops(args, 0)[0] / 2  # one multiply-add per weight
    dense = attention + 3 * args.dim * args.hidden_dim
    moe = args.moe
    if moe is None:
        return dense
    expert = moe.expert_ffn_dim or args.hidden_dim
    shared = 3 * args.dim * expert * moe.num_shared_experts + args.dim * moe.num_experts
    experts = 3 * args.dim * expert * moe.num_experts / degrees.ep if degrees.expert_shard > 1 else 0
    experts *= degrees.tp if degrees.ep_spans_tp else 1  # whole experts: the caller's division by tp does not apply
    return max(dense, attention + shared + experts)


class LlamaCost:
    """forge.models.spec.ModelCost of the Llama family."""

    def flops_per_token(self, args: TransformerArgs, seq_len: int) -> FlopsPerToken:
        return count_flops_per_token(args, seq_len)

    def block_activation_elems(self, args: TransformerArgs) -> float:
        return block_activation_elems(args)

    def block_unsplit_bytes(self, args: TransformerArgs, act_bytes: int) -> float:
        return moe_unsplit_bytes(args, act_bytes)

    def saved_kv_width(self, args: TransformerArgs) -> float:
        return saved_kv_width(args)

    def kv_width(self, args: TransformerArgs) -> float:
        return args.kv_width

    def block_gather_params(self, args: TransformerArgs, degrees: "Degrees") -> float:
        return block_gather_params(args, degrees)

    def block_norm_elems(self, args: TransformerArgs) -> float:
        return 2 * args.dim + (2 * args.head_size if args.qk_norm else 0)

    def host_tables_elems(self, args: TransformerArgs) -> float:
        """The rotary tables while they are computed: the angles, cos and sin."""
        return 3 * args.max_seq_len * args.rope_dim
