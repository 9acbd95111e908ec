"""The parallel plan: one function applies every transform to the meta-device model, in this order.

tensor parallel -> context parallel (and the MoE counts over it) -> expert parallel -> global-batch router loads ->
float8 (under tensor parallelism before it, so that the family's TP plan splits float8 linears with torchao's float8
styles) -> activation checkpointing -> compile (per block, or on one process the whole forward) -> FSDP2. It returns
what it applied, one record (forge.parallel.applied) per transform.

TP must come first because FSDP shards the DTensors TP produced (2-D parameters); checkpointing and compile
wrap whole blocks (or compile the whole forward around them), and FSDP wraps last so its hooks run outside the
checkpointed and compiled regions.
"""

import functools

import torch
from torch import nn
from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import CheckpointImpl, checkpoint_wrapper
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard
from torch.distributed.tensor import Shard
from torch.utils.checkpoint import (
    CheckpointPolicy,
    _CachedTorchDispatchMode,
    _is_compiling,
    create_selective_checkpoint_contexts,
)

from forge.config.degrees import Degrees
from forge.config.schema import ActivationCheckpoint, CompileScope, ParallelConfig
from forge.models.common.moe import moe_layers
from forge.models.spec import spec_of
from forge.parallel.applied import Applied, logged
from forge.parallel.context_parallel import apply_context_parallel
from forge.parallel.expert import (
    SplitRowsOverTp,
    local_part,
    shard_experts,
    sum_load_over,
    sum_sequence_counts_over,
    whole_expert_widths,
)
from forge.parallel.mesh import expert_fsdp_mesh, has_dp_shard, submesh, token_mesh

# Selective checkpointing keeps these ops' outputs and recomputes the cheap rest (norms, activations, rope).
SAVE_OPS = {
    torch.ops.aten.mm.default,
    torch.ops.aten._scaled_dot_product_flash_attention_for_cpu.default,
    torch.ops.aten._scaled_dot_product_efficient_attention.default,
    torch.ops.aten._scaled_dot_product_flash_attention.default,
    torch.ops.aten._scaled_dot_product_cudnn_attention.default,
}


def parallelize(
    model: nn.Module,
    mesh: DeviceMesh | None,
    degrees: Degrees,
    parallel_cfg: ParallelConfig,
    device: torch.device,
    compute_dtype: str = "fp32",
) -> list[Applied]:
    """Apply the plan of `parallel_cfg` to `model` (on the meta device) in place; mesh is None for one process.
    `compute_dtype` (bf16 or fp32, the resolved train.dtype) is what FSDP gathers parameters in by default.
    Returns what was applied, in order (empty when nothing was).

    With parallel.pp > 1, `model` is one pipeline stage: forge.parallel.pipeline.build_pipeline splits the whole
    model first and calls this on each stage.
    """
    applied: list[Applied | None] = []
    float8_first = parallel_cfg.fp8 and degrees.tp > 1  # the family's TP plan then splits them with float8 styles
    if float8_first:
        applied.append(apply_float8(model, degrees, device))
    if degrees.tp > 1:
        applied.append(spec_of(model).tensor_parallel(model, mesh["tp"]))  # the family's own plan
    if degrees.cp > 1:
        applied.append(apply_context_parallel(model, mesh["cp"]))
        applied.append(apply_sequence_router_counts(model, mesh["cp"]))
    if degrees.ep > 1:
        applied.append(apply_expert_parallel(model, mesh, degrees, parallel_cfg.ep_chunks))
    applied.append(apply_global_router_loads(model, mesh))
    if parallel_cfg.fp8 and not float8_first:
        applied.append(apply_float8(model, degrees, device))
    if parallel_cfg.activation_checkpoint != "none":
        applied.append(apply_activation_checkpointing(model, parallel_cfg.activation_checkpoint))
    if parallel_cfg.compile:
        if parallel_cfg.async_tp:
            applied.append(apply_async_tp(mesh["tp"]))
        applied.append(apply_compile(model, parallel_cfg.cuda_graphs, parallel_cfg.compile_scope))
    shard_mesh = fsdp_mesh(mesh)
    if shard_mesh is not None:
        policy = mixed_precision_policy(parallel_cfg, compute_dtype)
        applied += apply_fsdp(model, shard_mesh, expert_fsdp_mesh(mesh) if degrees.ep > 1 else None, policy)
    return [step for step in applied if step is not None]


def apply_expert_parallel(model: nn.Module, mesh: DeviceMesh, degrees: Degrees, chunks: int = 1) -> Applied:
    """Split every MoE layer's experts over the `ep` mesh dimension (borrowed from dp_shard, as in torchtitan),
    tokens moving to their experts and back by all-to-all in `chunks` overlapped parts. Router, attention and shared
    experts stay dense (under tp, split as without ep; the routed experts' widths stay split over tp too)."""
    if degrees.ep_spans_tp:  # whole experts over (ep / tp dp_shard ranks) x tp; each tp rank sends 1/tp of the rows
        whole_expert_widths(model)
        layers = shard_experts(model, submesh(mesh, "ep_tp"), None, chunks)
        tp_mesh = mesh["tp"]
        for _, layer in moe_layers(model):
            layer.dispatch = SplitRowsOverTp(layer.dispatch, tp_mesh.get_local_rank(), tp_mesh.size())
        borrowed = (
            f"{degrees.ep_data} of dp_shard={degrees.dp_shard} x tp={degrees.tp}; experts whole, each tp rank "
            f"sending 1/{degrees.tp} of every expert's rows"
        )
    else:
        layers = shard_experts(model, mesh["ep"], mesh["ep", "tp"] if degrees.tp > 1 else None, chunks)
        borrowed = f"from dp_shard={degrees.dp_shard}"
    if not layers:
        raise ValueError(f"parallel.ep={degrees.ep} but the model has no MoE layer")
    num_experts = moe_layers(model)[0][1].args.num_experts
    detail = (
        f"expert parallel over {degrees.ep} ranks (ep borrows {borrowed}): {layers} MoE layers, "
        f"{num_experts // degrees.ep} of {num_experts} experts per rank, tokens in {chunks} overlapped parts"
    )
    return logged(Applied("ep", detail, {"ep": degrees.ep}))


def apply_global_router_loads(model: nn.Module, mesh: DeviceMesh | None) -> Applied | None:
    """MoE layers with aux_loss_scope=global_batch balance the expert loads summed over the ranks holding a step's
    tokens, data-parallel and context-parallel (None when no layer does, or there is one such rank)."""
    tokens = token_mesh(mesh)
    if tokens is None or tokens.size() == 1:
        return None
    if not (layers := sum_load_over(tokens.get_group(), model)):
        return None
    detail = f"global-batch load balancing: {layers} MoE layers sum expert loads over {tokens.size()} token ranks"
    return logged(Applied("router_loads", detail, mesh_dims(tokens)))


def apply_sequence_router_counts(model: nn.Module, cp_mesh: DeviceMesh) -> Applied | None:
    """Under context parallelism the MoE layers' micro-batch and sequence balancing losses count the experts of the
    whole sequences: their counts are summed over the cp ranks (None for a dense model)."""
    if not (layers := sum_sequence_counts_over(cp_mesh.get_group(), model)):
        return None
    detail = f"MoE balancing of whole sequences: {layers} MoE layers sum expert counts over {cp_mesh.size()} cp ranks"
    return logged(Applied("router_counts", detail, {"cp": cp_mesh.size()}))


def apply_float8(model: nn.Module, degrees: Degrees, device: torch.device) -> Applied:
    """Swap the blocks' nn.Linear layers for torchao's Float8Linear (the output head stays in high precision).

    Off CUDA the float8 matmuls are emulated: the same float8 operands, dequantised in fp32 and multiplied there;
    only fp32 roundings and the summation order differ from a float8 kernel. torch's CPU `_scaled_mm` is a
    reference kernel hundreds of times slower than an fp32 matmul (benchmarks/train/fp8_cpu.py)."""
    try:
        from torchao.float8 import Float8LinearConfig, convert_to_float8_training
    except ImportError as err:
        raise RuntimeError("parallel.fp8=true needs torchao: pip install torchao") from err
    convert_to_float8_training(
        model,
        config=Float8LinearConfig(enable_fsdp_float8_all_gather=degrees.fsdp_shard > 1, emulate=device.type != "cuda"),
        module_filter_fn=float8_filter,
    )
    detail = "float8 training of the blocks' linear layers (torchao; MoE routers and odd shapes stay high precision)"
    return logged(Applied("fp8", detail))


def float8_filter(module: nn.Module, fqn: str) -> bool:
    """Which linears train in float8: the blocks' (not the head), except MoE router gates (routing decisions are
    sensitive to rounding, and the gate is tiny) and layers whose dimensions are not multiples of 16 (float8
    matmuls need them). Routed experts are grouped weights, not nn.Linear, and stay high precision."""
    if not isinstance(module, nn.Linear) or not fqn.startswith("layers.") or fqn.endswith("router.gate"):
        return False
    return module.in_features % 16 == 0 and module.out_features % 16 == 0


def float8_all_gather_enabled(model: nn.Module) -> bool:
    """Whether the model has float8 linears whose FSDP all-gather runs in float8 (their scales then need a refresh
    after every optimizer step: `precompute_float8_dynamic_scale_for_fsdp`)."""
    for module in model.modules():
        config = getattr(module, "config", None)
        if type(module).__name__ == "Float8Linear" and getattr(config, "enable_fsdp_float8_all_gather", False):
            return True
    return False


def apply_activation_checkpointing(model: nn.Module, mode: str) -> Applied:
    """Wrap every block: `full` recomputes the whole block in backward, `selective` keeps matmul and attention
    outputs and recomputes the rest."""
    kwargs = checkpoint_options(mode)
    for key, block in model.layers.items():
        model.layers[key] = checkpoint_wrapper(block, checkpoint_impl=CheckpointImpl.NO_REENTRANT, **kwargs)
    return logged(Applied("activation_checkpoint", f"activation checkpointing ({mode}) of {len(model.layers)} blocks"))


def checkpoint_options(mode: str) -> dict:
    """Keyword arguments of a non-reentrant checkpoint for `full` or `selective` activation checkpointing."""
    if mode == "selective":
        return {"context_fn": selective_contexts}
    if mode != "full":
        choices = ", ".join(ActivationCheckpoint)
        raise ValueError(f"parallel.activation_checkpoint={mode!r} is not one of {choices}")
    return {}


def _save_matmuls(ctx, op, *args, **kwargs) -> CheckpointPolicy:
    return CheckpointPolicy.MUST_SAVE if op in SAVE_OPS else CheckpointPolicy.PREFER_RECOMPUTE


def selective_contexts() -> tuple:
    """torch's selective-checkpoint pair (the forward keeps SAVE_OPS' outputs; the recompute replays them), with a
    recompute that counts only the kept ops.

    torch's replay numbers every op call and fails when the recompute calls an op more often than the forward did.
    FSDP's hooks of a module inside the block (the expert weights' own FSDP group under expert parallelism) call
    profiler and copy ops a different number of times in the recompute, which is not the model's computation
    (pytorch/torchtitan#3427). Everything outside SAVE_OPS is recomputed anyway, so it runs unnumbered; the kept ops
    are the model's matmuls and attention, which FSDP never calls, so their numbering still pairs each call with its
    saved output."""
    forward, recompute = create_selective_checkpoint_contexts(_save_matmuls)
    recompute.__class__ = _ReplayKeptOps
    return forward, recompute


class _ReplayKeptOps(_CachedTorchDispatchMode):
    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func not in SAVE_OPS and not _is_compiling(func, args, kwargs):  # traced graphs keep torch's marking
            return func(*args, **kwargs)
        return super().__torch_dispatch__(func, types, args, kwargs)


def apply_async_tp(tp_mesh: DeviceMesh) -> Applied:
    """Asynchronous TP: inductor micro-pipelines each tensor-parallel matmul with its collective over CUDA symmetric
    memory (validation allows it only with tp > 1, compile and CUDA). torch 2.13 marks its group registration
    deprecated, yet inductor's pass still fuses only for groups registered by it."""
    import warnings

    import torch._inductor.config
    from torch.distributed._symmetric_memory import enable_symm_mem_for_group

    torch._inductor.config._micro_pipeline_tp = True
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", FutureWarning)
        enable_symm_mem_for_group(tp_mesh.get_group().group_name)
    detail = f"async tensor parallelism over {tp_mesh.size()} ranks (inductor's micro-pipelined matmuls, collectives)"
    return logged(Applied("async_tp", detail, {"tp": tp_mesh.size()}))


def apply_compile(model: nn.Module, cuda_graphs: bool = False, scope: str = CompileScope.blocks) -> Applied:
    """torch.compile the model's blocks or its whole forward (parallel.compile_scope).

    `blocks`: each block separately; blocks are identical, so one compiled graph serves all. `model`: the model's
    class is swapped for a subclass whose forward is compiled (as activation checkpointing swaps a VLM's, so a
    deepcopy still runs its own weights): one graph from the embedded tokens to the logits. The token embedding
    stays eager: inductor's embedding backward adds the rows of repeated tokens with atomic adds, in a different
    order each run; torch's own kernel sums them in one.

    `cuda_graphs` (parallel.cuda_graphs): the compiled graphs are replayed as CUDA graphs (torch.compile's
    reduce-overhead mode, inductor's cudagraph trees: after warm-up runs, recorded once per shape and mode,
    training and evaluation apart), and every forward of the whole model begins a new step of them: its
    micro-batch's graphs may overwrite the last one's outputs, whose backward is done.
    """
    mode = "reduce-overhead" if cuda_graphs else None
    if CompileScope(scope) == CompileScope.model:
        model.__class__ = compiled_class(type(model), mode)
        if model.tok_embeddings is not None:
            model.tok_embeddings.__class__ = eager_class(type(model.tok_embeddings))
        what = f"torch.compile of the whole forward ({len(model.layers)} blocks) as one graph"
    else:
        for key, block in model.layers.items():
            model.layers[key] = torch.compile(block, mode=mode)
        what = f"torch.compile of {len(model.layers)} block{'s' if len(model.layers) != 1 else ''}"
    if cuda_graphs:
        model.register_forward_pre_hook(_begin_graph_step)
    how = ", replayed as CUDA graphs" if cuda_graphs else ""
    return logged(Applied("compile", what + how))


# One subclass per class (and mode), not per model: dynamo guards on the type of the compiled forward's `self`, so
# a class per instance would compile each model anew and, past torch's recompile limit (8), silently run eager.
@functools.cache
def compiled_class(cls: type, mode: str | None) -> type:
    """`cls` with its forward compiled (parallel.compile_scope=model)."""
    return type(f"Compiled{cls.__name__}", (cls,), {"forward": torch.compile(cls.forward, mode=mode)})


@functools.cache
def eager_class(cls: type) -> type:
    """`cls` with its forward kept out of an enclosing compiled graph."""
    return type(f"Eager{cls.__name__}", (cls,), {"forward": torch.compiler.disable(cls.forward)})


def _begin_graph_step(module: nn.Module, args: tuple) -> None:
    """Forward pre-hook of the whole model under parallel.cuda_graphs: a new step of the replayed graphs."""
    torch.compiler.cudagraph_mark_step_begin()


def fsdp_mesh(mesh: DeviceMesh | None) -> DeviceMesh | None:
    """The mesh FSDP2 shards over: (dp_replicate, dp_shard) for HSDP and DDP, dp_shard for FSDP, else None.
    Context-parallel ranks hold the same parameters, so cp joins the shard dimension (dp_shard_cp)."""
    names = (mesh.mesh_dim_names or ()) if mesh is not None else ()
    if "cp" in names:
        return submesh(mesh, *(("dp_replicate",) if "dp_replicate" in names else ()), "dp_shard_cp")
    if "dp_replicate" in names:
        return submesh(mesh, "dp_replicate", "dp_shard")
    if has_dp_shard(mesh):
        return submesh(mesh, "dp_shard")
    return None


def mesh_dims(mesh: DeviceMesh) -> dict[str, int]:
    """{dimension name: size} of a named mesh."""
    return dict(zip(mesh.mesh_dim_names, mesh.shape))


DTYPES = {"bf16": torch.bfloat16, "fp32": torch.float32}


def param_dtype(parallel_cfg: ParallelConfig, compute_dtype: str) -> str:
    """The dtype the parameters compute in: parallel.param_dtype, or (null) the compute dtype. FSDP gathers in it,
    and one process computes on a copy in it (forge.train.compute_weights)."""
    return parallel_cfg.param_dtype or compute_dtype


def mixed_precision_policy(parallel_cfg: ParallelConfig, compute_dtype: str) -> MixedPrecisionPolicy:
    """FSDP2's policy: parameters gathered in `param_dtype`, gradients reduced in parallel.reduce_dtype. Under
    bf16 this halves the all-gather bytes and the unsharded parameter memory of an fp32 gather; the sharded fp32
    parameters stay the optimizer's master weights."""
    param = param_dtype(parallel_cfg, compute_dtype)
    reduce = parallel_cfg.reduce_dtype or "fp32"
    return MixedPrecisionPolicy(param_dtype=DTYPES[param], reduce_dtype=DTYPES[reduce])


def apply_fsdp(
    model: nn.Module,
    mesh: DeviceMesh,
    expert_mesh: DeviceMesh | None = None,
    policy: MixedPrecisionPolicy | None = None,
) -> list[Applied]:
    """FSDP2 per block, then the root (embedding, norm, head). On a 2-D mesh the first dimension replicates
    (HSDP); with a shard dimension of size 1 this is plain data parallelism with all-reduced gradients.

    With expert parallelism each MoE layer's experts are wrapped first, on `expert_mesh` (the data-parallel ranks
    that hold the same experts), so the block's own FSDP group leaves them out; their record comes first.
    """
    policy = policy or MixedPrecisionPolicy()
    for block in model.layers.values():
        if expert_mesh is not None:
            for _, layer in moe_layers(block):
                fully_shard_experts(layer.experts, expert_mesh, mesh.size(), policy)
        fully_shard(block, mesh=mesh, mp_policy=policy)
    fully_shard(model, mesh=mesh, mp_policy=policy)
    applied = []
    if expert_mesh is not None:
        shape = mesh_dims(expert_mesh)
        detail = f"FSDP of the expert weights over mesh {shape} (x ep), gradients divided by {mesh.size()} dp ranks"
        applied.append(logged(Applied("expert_fsdp", detail, shape)))
    if mesh.ndim == 1:
        kind = "FSDP"
    else:
        kind = "HSDP" if mesh.size(1) > 1 else "DDP (FSDP2 on a replicate-only mesh)"
    shape = mesh_dims(mesh)
    blocks = len(model.layers)
    detail = f"{kind} over mesh {shape}: {blocks} blocks and the root ({policy_dtypes(policy)})"
    applied.append(logged(Applied("fsdp", detail, shape)))
    return applied


def policy_dtypes(policy: MixedPrecisionPolicy) -> str:
    """'gathers <dtype>, reduces <dtype>': what an FSDP record says of its policy."""
    gathered = str(policy.param_dtype or torch.float32).removeprefix("torch.")
    reduced = str(policy.reduce_dtype or policy.param_dtype or torch.float32).removeprefix("torch.")
    return f"gathers {gathered}, reduces {reduced}"


def fully_shard_experts(
    experts: nn.Module, mesh: DeviceMesh, dp_size: int, policy: MixedPrecisionPolicy | None = None
) -> None:
    """FSDP2 over the ranks sharing these experts. Every data-parallel rank's tokens reach them through the
    all-to-all, so the summed gradient is divided by all `dp_size` ranks, not by this smaller group's size.

    FSDP shards dim 0 by default: the rank's E / ep experts. When they do not split evenly over the shard group
    (Mixtral's 8 experts over ep 8 leave one expert for 8 ranks), FSDP would pad every rank's shard to a whole
    expert, so the weights are sharded on their next dimension instead (as torchtitan does)."""
    shards = mesh.size(mesh.ndim - 1)
    uneven = any(local_part(p).shape[0] % shards for p in experts.parameters())
    widths_split = all(p.shape[1] % shards == 0 for p in experts.parameters())  # FSDP refuses uneven dim 1
    placement = (lambda param: Shard(1)) if uneven and widths_split else None
    fully_shard(experts, mesh=mesh, mp_policy=policy or MixedPrecisionPolicy(), shard_placement_fn=placement)
    experts.set_gradient_divide_factor(float(dp_size))
    if shards > 1:
        # Plain sums, then a division: gloo has no pre-multiplied sum. (Not on a shard group of one rank: there
        # FSDP already divides while copying, and forcing sums would divide a second time.)
        experts.set_force_sum_reduction_for_comms(True)


def count_local_parameters(model: nn.Module) -> int:
    """Elements of the parameters this rank holds (its shards of DTensors)."""
    return sum(getattr(p, "_local_tensor", p).numel() for p in model.parameters())
