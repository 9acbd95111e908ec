"""The device mesh of a run, built from the resolved parallel degrees."""

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh
from torch.distributed.tensor import DTensor
from torch.distributed.tensor._redistribute import clear_redistribute_planner_cache

from forge.config.degrees import Degrees

# Outer to inner: pipeline stages talk least, tensor-parallel ranks most (so tp stays inside a node); context
# parallelism all-gathers keys and values every layer, so it sits next to tp, as in torchtitan. With expert
# parallelism dp_shard is split into (dp_shard_mod_ep, ep): ep borrows the inner FSDP ranks, as in torchtitan.
MESH_DIMS = ("pp", "dp_replicate", "dp_shard", "dp_shard_mod_ep", "ep", "cp", "tp")


def mesh_shape(degrees: Degrees) -> dict[str, int]:
    """Named sizes of the mesh dimensions, size-1 dimensions left out.

    dp_shard stays (at size 1) when dp_replicate > 1, so pure data parallelism runs as FSDP2 on a
    (dp_replicate, dp_shard=1) mesh: replicated parameters and all-reduced gradients, like DDP.
    With ep > 1, dp_shard becomes (dp_shard_mod_ep = dp_shard / ep, ep), the first kept at size 1 too: expert
    weights are sharded over ep and FSDP-sharded over dp_shard_mod_ep (replicated when that is 1); `build_mesh`
    flattens the two back into dp_shard for the other weights. When ep spans the tp ranks (parallel.ep_spans_tp)
    the ep dimension holds ep / tp of the dp_shard ranks, and `build_mesh` flattens it with tp into the experts'
    group (ep_tp).
    """
    sizes = {
        "pp": degrees.pp,
        "dp_replicate": degrees.dp_replicate,
        "dp_shard": degrees.dp_shard,
        "cp": degrees.cp,
        "tp": degrees.tp,
    }
    keep = {name: size for name, size in sizes.items() if size > 1}
    if degrees.dp_replicate > 1 and "dp_shard" not in keep:
        keep["dp_shard"] = 1
    if degrees.ep > 1 and ("dp_shard" in keep or degrees.cp > 1):  # (not when ep spans the tp ranks of tp alone)
        keep.pop("dp_shard", None)
        keep["dp_shard_mod_ep"] = degrees.dp_shard // degrees.ep_data
        keep["ep"] = degrees.ep_data  # with ep_spans_tp (size 1 when ep = tp), build_mesh flattens it with tp
    return {name: keep[name] for name in MESH_DIMS if name in keep}


def build_mesh(degrees: Degrees, device_type: str) -> DeviceMesh | None:
    """The DeviceMesh over all ranks, or None for a single process."""
    if degrees.world_size == 1:
        return None
    if not dist.is_initialized():
        raise RuntimeError("build_mesh needs an initialised process group (forge.parallel.dist.init_distributed)")
    forget_earlier_meshes()
    shape = mesh_shape(degrees)
    mesh = init_device_mesh(device_type, tuple(shape.values()), mesh_dim_names=tuple(shape))
    flattened: dict[tuple[str, ...], DeviceMesh] = {}
    if "ep" in shape:
        flattened["dp_shard",] = mesh["dp_shard_mod_ep", "ep"]._flatten("dp_shard")
    if degrees.ep_spans_tp and degrees.ep > 1:  # the expert-parallel group: ep / tp dp_shard ranks x the tp ranks
        flattened["ep_tp",] = mesh["ep", "tp"]._flatten("ep_tp") if "ep" in shape else mesh["tp"]
    dp_dims = dp_dim_names(mesh)
    if len(dp_dims) > 1:
        flattened["dp",] = mesh[dp_dims]._flatten("dp")
    if "ep" in shape and "dp_replicate" in shape:
        sizes = (degrees.dp_replicate, degrees.dp_shard)
        flattened["dp_replicate", "dp_shard"] = _unflatten(flattened["dp",], mesh, sizes)
    if "cp" in shape:
        shard_dims = tuple(name for name in ("dp_shard", "dp_shard_mod_ep", "ep", "cp") if name in shape)
        flattened["dp_shard_cp",] = mesh[shard_dims]._flatten("dp_shard_cp") if len(shard_dims) > 1 else mesh["cp"]
        if "ep" in shape:  # the experts' FSDP group: the ranks holding the same experts, cp peers included
            flattened["expert_shard",] = mesh["dp_shard_mod_ep", "cp"]._flatten("expert_shard")
        token_dims = (*dp_dims, "cp")
        if len(token_dims) > 1:
            flattened["dp_cp",] = mesh[token_dims]._flatten("dp_cp")
        if "dp_replicate" in shape:
            sizes = (degrees.dp_replicate, degrees.fsdp_shard)
            flattened["dp_replicate", "dp_shard_cp"] = _unflatten(
                flattened["dp_cp",], mesh, sizes, ("dp_replicate", "dp_shard_cp")
            )
            if "ep" in shape:
                experts = mesh["dp_replicate", "dp_shard_mod_ep", "cp"]._flatten("dp_replicate_expert_shard")
                sizes = (degrees.dp_replicate, degrees.expert_shard)
                flattened["dp_replicate", "expert_shard"] = _unflatten(
                    experts, mesh, sizes, ("dp_replicate", "expert_shard")
                )
    setattr(mesh, _FLATTENED, flattened)
    return mesh


def forget_earlier_meshes() -> None:
    """Drop DTensor's caches of sharding results, which hold the meshes they were computed on.

    DeviceMesh equality compares ranks, shape and names but not process groups, so a mesh equal to one of an
    earlier process group in this process (an earlier run, or a forked parent's simulated world) would get cached
    results carrying the earlier mesh, whose groups no longer resolve: "Could not resolve the process group
    registered under the name 3" at the first collective on such a result. The caches are per thread and this
    clears the calling thread's, the only one a forked run has; on CUDA the backward's DTensor ops run on autograd's
    device threads, whose caches an earlier run in the same process would still hold.
    """
    propagator = DTensor._op_dispatcher.sharding_propagator
    propagator.propagate_op_sharding.cache_clear()
    propagator._propagate_tensor_meta_cached.cache_clear()
    torch._C._clear_DTensor_sharding_propagator_cache()  # the C++ fast path's (torch.distributed.tensor.debug's)
    clear_redistribute_planner_cache()


def submesh(mesh: DeviceMesh, *names: str) -> DeviceMesh:
    """mesh[names], where a name may be a dimension `build_mesh` flattened (dp, or dp_shard under ep).

    Slicing a flattened dimension out of the root mesh is deprecated in PyTorch, so the flattened meshes are kept
    on the root mesh when they are made and looked up here.
    """
    kept = getattr(mesh, _FLATTENED, {})
    if names in kept:
        return kept[names]
    return mesh[names[0]] if len(names) == 1 else mesh[names]


# Attribute of a root mesh holding the meshes build_mesh flattened from it, keyed by their dimension names.
_FLATTENED = "_forge_flattened"


def _unflatten(
    dp: DeviceMesh, root: DeviceMesh, sizes: tuple[int, int], names: tuple[str, str] = ("dp_replicate", "dp_shard")
) -> DeviceMesh:
    """The 2-D (dp_replicate, shard) mesh whose shard dimension is itself flattened: dp_shard from
    (dp_shard_mod_ep, ep), or dp_shard_cp from (dp_shard, cp)."""
    if hasattr(dp, "_unflatten"):  # PyTorch >= 2.10
        return dp._unflatten(0, sizes, names)
    return root[names]


def dp_dim_names(mesh: DeviceMesh) -> tuple[str, ...]:
    """The data-parallel dimensions of the mesh's shape, outer first (ep and dp_shard_mod_ep split dp_shard)."""
    names = ("dp_replicate", "dp_shard", "dp_shard_mod_ep", "ep")
    return tuple(name for name in names if name in (mesh.mesh_dim_names or ()))


def has_dp_shard(mesh: DeviceMesh | None) -> bool:
    """The mesh has a dp_shard dimension (its own, or flattened from dp_shard_mod_ep x ep)."""
    names = (mesh.mesh_dim_names or ()) if mesh is not None else ()
    return "dp_shard" in names or "ep" in names


def expert_fsdp_mesh(mesh: DeviceMesh) -> DeviceMesh:
    """The mesh FSDP2 shards expert weights over: dp_shard_mod_ep (with cp, flattened with it: expert_shard), with
    dp_replicate in front for HSDP."""
    names = mesh.mesh_dim_names or ()
    shard = "expert_shard" if "cp" in names else "dp_shard_mod_ep"
    return submesh(mesh, *(("dp_replicate",) if "dp_replicate" in names else ()), shard)


def dp_mesh(mesh: DeviceMesh | None) -> DeviceMesh | None:
    """The 1-D mesh over the data-parallel ranks of this rank (flattened when dp has two dimensions)."""
    if mesh is None:
        return None
    dims = dp_dim_names(mesh)
    if not dims:
        return None
    return submesh(mesh, "dp" if len(dims) > 1 else dims[0])


def dp_rank_and_size(mesh: DeviceMesh | None) -> tuple[int, int]:
    """(rank, size) of this process among the data-parallel ranks; tensor-parallel peers share data."""
    sub = dp_mesh(mesh)
    if sub is None:
        return 0, 1
    return sub.get_local_rank(), sub.size()


def token_mesh(mesh: DeviceMesh | None) -> DeviceMesh | None:
    """The 1-D mesh over the ranks that hold different tokens of a step: the data-parallel ranks, and with context
    parallelism each one's cp peers (which hold other positions of the same sequences)."""
    if mesh is None or "cp" not in (mesh.mesh_dim_names or ()):
        return dp_mesh(mesh)
    return submesh(mesh, "dp_cp" if dp_dim_names(mesh) else "cp")


def token_ranks(mesh: DeviceMesh | None) -> int:
    """How many ranks hold different tokens of a step (dp x cp); the gradients are averaged over them."""
    sub = token_mesh(mesh)
    return 1 if sub is None else sub.size()


def sum_over_token_ranks(value: torch.Tensor, mesh: DeviceMesh | None) -> torch.Tensor:
    """Sum a tensor over the ranks of `token_mesh` (a copy; the value itself for one rank)."""
    total, pending = start_sum_over_token_ranks(value, mesh)
    if pending is not None:
        pending.wait()
    return total


def start_sum_over_token_ranks(value: torch.Tensor, mesh: DeviceMesh | None) -> tuple[torch.Tensor, dist.Work | None]:
    """`sum_over_token_ranks` issued without waiting: (the sum once the work is waited on, the work or None for one
    rank). Work issued between the two overlaps the all-reduce."""
    sub = token_mesh(mesh)
    if sub is None or sub.size() == 1:
        return value, None
    total = value.detach().clone()
    return total, dist.all_reduce(total, group=sub.get_group(), async_op=True)


def stage_groups(mesh: DeviceMesh | None, world_size: int) -> list[list[int]]:
    """The ranks that do the same work, grouped: one group per pipeline stage, or every rank in one."""
    if mesh is None or "pp" not in (mesh.mesh_dim_names or ()):
        return [list(range(world_size))]
    ranks = mesh.mesh.movedim(mesh.mesh_dim_names.index("pp"), 0)
    return [stage.flatten().tolist() for stage in ranks]
