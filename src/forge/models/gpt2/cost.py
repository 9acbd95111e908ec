"""The cost of GPT-2, counted from its arguments: what metrics, `--plan` and the layout search read
(forge.models.spec.ModelCost).

FLOPs: matmuls only (2 FLOPs per multiply-add); LayerNorms, GELU, softmax, biases and the embedding lookups are
left out, as in Llama's count (forge.models.llama.cost). Attention counts the full seq_len x seq_len score and
value products (no causal halving).

Activations, per token and block, what autograd keeps for the backward (the model's own code,
forge.models.gpt2.model): ln_1's input and output (2 d, the output is c_attn's matmul input), c_attn's output (3 d,
the q, k and v SDPA keeps as views of it), SDPA's output (d), its re-laid-out copy fed to c_proj (d), ln_2's input
and output (2 d, the output is c_fc's input), c_fc's output (f, GELU's input) and GELU's output (f, c_proj's
input): 9 d + 2 f. The bias adds and the residual sums keep nothing. forge.planning.memory adds the norms'
upcasts under bf16 and, under tensor parallelism, the all-gathered inputs of c_attn and c_fc (2 d).
"""

from typing import TYPE_CHECKING

from forge.models.gpt2.args import GPT2Args
from forge.models.spec import FlopsPerToken

if TYPE_CHECKING:
    from forge.config.degrees import Degrees


class GPT2Cost:
    """forge.models.spec.ModelCost of GPT-2."""

    def flops_per_token(self, args: GPT2Args, seq_len: int) -> FlopsPerToken:
        dim, layers = args.dim, args.n_layers
        return FlopsPerToken(
            attention_projections=layers * 2 * (dim * 3 * dim + dim * dim),  # c_attn, c_proj
            attention_scores=layers * 2 * 2 * dim * seq_len,  # QK^T and the weighted sum of V, over all heads
            mlp=layers * 2 * 2 * dim * args.hidden_dim,  # c_fc, c_proj
            moe=0.0,
            head=2 * dim * args.vocab_size,
        )

    def block_activation_elems(self, args: GPT2Args) -> float:
        """9 d + 2 f (see the module docstring)."""
        return 9 * args.dim + 2 * args.hidden_dim

    def block_unsplit_bytes(self, args: GPT2Args, act_bytes: int) -> float:
        """None: every activation is split under tensor parallelism."""
        return 0.0

    def saved_kv_width(self, args: GPT2Args) -> float:
        """Keys and values, all heads: 2 d."""
        return 2 * args.dim

    def kv_width(self, args: GPT2Args) -> float:
        """Keys and values, all heads: 2 d."""
        return 2 * args.dim

    def block_gather_params(self, args: GPT2Args, degrees: "Degrees") -> float:
        """One block's parameters (12 d^2 + 13 d at GPT-2's f = 4 d): c_attn, attention c_proj, c_fc, MLP c_proj
        (weights and biases) and two LayerNorms."""
        dim, hidden = args.dim, args.hidden_dim
        attention = 3 * dim * dim + 3 * dim + dim * dim + dim
        mlp = dim * hidden + hidden + hidden * dim + dim
        return attention + mlp + 4 * dim

    def block_norm_elems(self, args: GPT2Args) -> float:
        """The parameters whose gradients tensor parallelism all-reduces: the two LayerNorms' weights and biases
        (4 d), and the replicated biases of the two row-parallel c_proj (2 d, forge.models.gpt2.parallelize)."""
        return 6 * args.dim

    def host_tables_elems(self, args: GPT2Args) -> float:
        """None: positions are a learned embedding, not a computed table."""
        return 0.0
