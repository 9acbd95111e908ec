"""The tensor-parallel plan of the Llama decoder: Megatron-style column/row splits with sequence parallel norms; MoE
feed-forward layers split each expert's hidden width (forge.models.llama.expert_tensor)."""

from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import Replicate, Shard
from torch.distributed.tensor.parallel import (
    ColwiseParallel,
    RowwiseParallel,
    SequenceParallel,
    parallelize_module,
)

from forge.models.common.feed_forward import FeedForward
from forge.models.common.moe import MoE
from forge.models.llama.expert_tensor import apply_moe_tensor_parallel
from forge.models.llama.latent_attention import LatentAttention
from forge.models.llama.latent_tensor import apply_latent_tensor_parallel
from forge.models.llama.transformer import Transformer
from forge.parallel.applied import Applied, logged
from forge.parallel.float8_styles import tensor_parallel_styles


def apply_tensor_parallel(model: Transformer, tp_mesh: DeviceMesh) -> Applied:
    """Split heads and MLP columns over `tp_mesh`; activations between blocks are sharded along the sequence.

    Attention reshapes with -1 heads, so each rank runs attention on its own heads unchanged. The residual stream
    stays a DTensor sharded along the sequence (so the model still sees the global sequence length, which sizes
    its rotary tables). The logits stay split over the vocabulary (a DTensor sharded on its last dim): no rank
    holds the (tokens x vocab) logits, the largest activation at a 128k vocabulary, and none is all-gathered; the
    losses compute softmax statistics over the shards (forge.train.losses, under `loss_parallel`).
    """
    root_plan = {}
    if model.tok_embeddings is not None:
        root_plan["tok_embeddings"] = RowwiseParallel(
            input_layouts=Replicate(), output_layouts=Shard(1), use_local_output=False
        )
    if model.norm is not None:
        root_plan["norm"] = SequenceParallel()
    if model.output is not None:
        root_plan["output"] = ColwiseParallel(input_layouts=Shard(1), output_layouts=Shard(-1), use_local_output=False)
    parallelize_module(model, tp_mesh, root_plan)
    model.tie_weights()  # both splits are Shard(0) of the (vocab, dim) matrix: one DTensor serves both
    for block in model.layers.values():
        latent = isinstance(block.attention, LatentAttention)
        plan = {"attention_norm": SequenceParallel(), "ffn_norm": SequenceParallel()}
        if not latent:
            attention = block.attention
            colwise, rowwise, prepare = tensor_parallel_styles(tp_mesh, attention.wq, attention.wk, attention.wv)
            plan |= {
                # (x, cos, sin, attn_mask): only x is an activation to gather.
                "attention": prepare(
                    input_layouts=(Shard(1), None, None, None), desired_input_layouts=(Replicate(), None, None, None)
                ),
                "attention.wq": colwise(),
                "attention.wk": colwise(),
                "attention.wv": colwise(),
                "attention.wo": rowwise(output_layouts=Shard(1), use_local_output=False),
            }
        if model.args.qk_norm:
            # q and k are (batch, seq, local heads, head_dim): each rank norms its own heads over head_dim with the
            # replicated weight, whose gradient (a sum over every rank's heads) is all-reduced like the other norms'
            plan |= {
                f"attention.{norm}": SequenceParallel(sequence_dim=2, use_local_output=True)
                for norm in ("q_norm", "k_norm")
            }
        if isinstance(block.feed_forward, FeedForward):
            colwise, rowwise, prepare = tensor_parallel_styles(tp_mesh, block.feed_forward.w1, block.feed_forward.w3)
            plan |= {
                "feed_forward": prepare(input_layouts=(Shard(1),), desired_input_layouts=(Replicate(),)),
                "feed_forward.w1": colwise(),
                "feed_forward.w3": colwise(),
                "feed_forward.w2": rowwise(output_layouts=Shard(1), use_local_output=False),
            }
        parallelize_module(block, tp_mesh, plan)
        if latent:
            apply_latent_tensor_parallel(block.attention, tp_mesh)
        if isinstance(block.feed_forward, MoE):
            apply_moe_tensor_parallel(block.feed_forward, tp_mesh)
    detail = f"tensor parallel over {tp_mesh.size()} ranks: embedding, {len(model.layers)} blocks, norm, output "
    detail += "(logits split over the vocabulary)"
    moe_blocks = sum(isinstance(block.feed_forward, MoE) for block in model.layers.values())
    if moe_blocks:
        detail += f"; {moe_blocks} MoE layers: experts' hidden widths split, router replicated"
    if any(type(module).__name__ == "Float8Linear" for module in model.modules()):
        detail += "; float8 linears split with torchao's float8 styles"
    if model.args.attention_kind == "mla":
        detail += "; latent attention: heads split, low-rank down-projections replicated"
    return logged(Applied("tp", detail, {"tp": tp_mesh.size()}))
