"""Tensor parallelism of multi-head latent attention (forge.models.llama.latent_attention), as DeepSeek-V3's published
TP plans split it: the heads over the tp ranks (the query's up-projection wq_b or wq, the latent's expansion wkv_b by
their output rows, wo by its input columns), the low-rank down-projections wq_a and wkv_a, their norms and so the
shared rotary key replicated (each rank computes them whole from the all-gathered sequence; their weights' partial
gradients are summed over the tp ranks). The attention's output is each rank's partial sum, reduce-scattered back
along the sequence (forge.parallel.local_tp). The attention code itself is unchanged: it reshapes with -1 heads.
"""

from torch.distributed.device_mesh import DeviceMesh

from forge.models.llama.latent_attention import LatentAttention
from forge.parallel.local_tp import gather_sequence, local_linear, local_rms_norm, scatter_sequence


def apply_latent_tensor_parallel(attention: LatentAttention, tp_mesh: DeviceMesh) -> None:
    heads = ("wq",) if hasattr(attention, "wq") else ("wq_b",)
    for name in (*heads, "wkv_b"):
        local_linear(getattr(attention, name), tp_mesh, split=0)
    local_linear(attention.wo, tp_mesh, split=1)
    for name in ("wq_a", "wkv_a"):
        if hasattr(attention, name):
            local_linear(getattr(attention, name), tp_mesh, split=None)
    for name in ("q_a_norm", "kv_a_norm"):
        if hasattr(attention, name):
            local_rms_norm(getattr(attention, name), tp_mesh)

    def gather_input(module, args: tuple, kwargs: dict):
        return (gather_sequence(args[0], tp_mesh), *args[1:]), kwargs

    attention.register_forward_pre_hook(gather_input, with_kwargs=True)
    attention.register_forward_hook(lambda module, args, out: scatter_sequence(out, tp_mesh))
