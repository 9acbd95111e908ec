"""The arguments of a routed mixture-of-experts layer (forge.models.common.moe), which any family's blocks may
use in place of their dense MLP. Imports without torch (the config schemas extend them)."""

from dataclasses import dataclass
from enum import StrEnum

from forge.domain import domain


class RouterKind(StrEnum):
    """MoEArgs.router's choices (forge.models.common.moe.router)."""

    softmax_topk = "softmax_topk"
    sigmoid_topk = "sigmoid_topk"


class AuxLossScope(StrEnum):
    """MoEArgs.aux_loss_scope's choices (forge.models.common.moe.layer)."""

    micro_batch = "micro_batch"
    sequence = "sequence"
    global_batch = "global_batch"


@dataclass
class MoEArgs:
    """Routed mixture-of-experts replacing the dense MLP in every `every`-th block."""

    num_experts: int = domain(8, ge=1)
    """Routed experts per MoE layer."""
    top_k: int = domain(2, ge=1)
    """Experts each token is sent to."""
    num_shared_experts: int = domain(0, ge=0)
    """Always-active experts added to the routed output."""
    expert_ffn_dim: int = domain(0, ge=0, means="0: the dense ffn size")
    """Hidden size of one expert; 0 uses the dense ffn size (smaller values give fine-grained experts)."""
    every: int = domain(1, ge=1)
    """An MoE layer in every k-th block (block i is MoE when (i + 1) % every == 0)."""
    first_dense: int = domain(0, ge=0)
    """Blocks below this index keep the dense MLP whatever `every` says (DeepSeek-V3's first_k_dense_replace)."""
    expert_groups: int = domain(1, ge=1)
    """Experts split into this many equal groups for group-limited routing (DeepSeek-V3's n_group, 8); a group
    scores the sum of its two best selection scores."""
    groups_per_token: int = domain(1, ge=1)
    """Groups a token may choose its experts from, the best-scoring ones (DeepSeek-V3's topk_group, 4); with
    expert_groups=1 every expert is a candidate."""
    route_scale: float = domain(1.0, gt=0)
    """Factor on the k combine weights after they are renormalised (DeepSeek-V3's routed_scaling_factor, 2.5)."""
    capacity_factor: float = domain(0.0, ge=0, means="0: dropless")
    """Tokens per expert allowed as a multiple of the even share; 0 is dropless."""
    router: RouterKind = RouterKind.softmax_topk
    """Router kind: softmax_topk (aux-loss balanced) or sigmoid_topk (aux-loss-free bias balancing)."""
    aux_loss_coef: float = domain(0.01, ge=0)
    """Weight of the Switch-style load-balancing loss (softmax router). The loss scores 1 for a perfectly even
    router (E * sum f_i P_i with f over the k assignments); HF Mixtral / GShard's scores top_k, so their
    coefficient c corresponds to c x top_k here."""
    z_loss_coef: float = domain(0.001, ge=0)
    """Weight of the router z-loss."""
    bias_update_rate: float = domain(0.001, ge=0)
    """Step size of the per-expert bias update (sigmoid router): bias += rate * sign(mean load - load) per step.
    Unused with balanced_selection, whose bias takes the solved offsets instead (a rate of 0 then freezes nothing)."""
    balanced_selection: bool = False
    """Training forwards choose experts with per-expert offsets solved on the tokens the layer routes, so each expert
    gets its even share (not with group-limited routing; forge.models.common.moe.router.balancing_offsets; no
    gradient). A sigmoid router's bias then moves to the step's mean offsets, so evaluation and exports route
    near-evenly with the bias alone; a softmax router evaluates with plain top-k, as Mixtral and Qwen3-MoE run, and
    its aux loss has little to correct while the choice is balanced, so its top-k is less even than training's.
    Holds the balance while the hidden states of an early, fast-learning run are nearly alike, where sign updates
    lag behind. Each micro-batch is solved on its own: tensor parallelism (which gathers the sequence) chooses as
    one process; data and expert parallel ranks as one process accumulating the same micro-batches; under context
    or pipeline parallelism each rank balances its part of the sequences or its pipeline micro-batch."""
    aux_loss_scope: AuxLossScope = AuxLossScope.micro_batch
    """Tokens the load-balancing loss averages over: micro_batch (Switch, each rank's micro-batch), sequence
    (DeepSeek-V3's per-sequence loss, averaged over the sequences) or global_batch (the expert loads of the
    micro-batches all data-parallel ranks run at once are summed, so the ranks' mean loss equals one process's
    over all their tokens; without gradient accumulation that is the whole global batch)."""
    grouped_mm: bool = True
    """Run the experts as grouped GEMMs (torch._grouped_mm), with no host sync. One matmul chain per expert instead,
    which reads the counts on the host: with false, a build without them, widths their 16-byte strides do not fit
    (bf16: dim and expert width multiples of 8), or a dtype other than bf16 on a GPU or under torch.compile (fp32
    runs grouped on a CPU only)."""

    def __post_init__(self) -> None:
        self.router, self.aux_loss_scope = str(self.router), str(self.aux_loss_scope)  # plain, as TransformerArgs'

    def in_block(self, layer_id: int) -> bool:
        """Whether block `layer_id` (from 0) runs this MoE in place of the dense MLP."""
        return layer_id >= self.first_dense and (layer_id + 1) % self.every == 0
