"""Initial weights of a parallelized model, identical to a single process's with the same seed."""

import torch
from torch import nn
from torch.distributed.tensor import DTensor
from torch.distributed.tensor._utils import compute_local_shape_and_global_offset
from torch.distributed.tensor.placement_types import Replicate, Shard, _StridedShard

from forge.models.common.init_spec import fill_piece_

# Wrappers that the plan adds around blocks; stripped to match the plain model's names.
_WRAPPER_PREFIXES = ("_checkpoint_wrapped_module.", "_orig_mod.")


def has_dtensor_parameters(model: nn.Module) -> bool:
    return any(isinstance(p, DTensor) for p in model.parameters())


def plain_name(name: str) -> str:
    for prefix in _WRAPPER_PREFIXES:
        name = name.replace(prefix, "")
    return name


def local_piece(param: DTensor) -> tuple[tuple[int, ...], tuple[int, ...]]:
    """Shape and global offset of this rank's shard of `param`.

    Every placement the plan makes (FSDP Shard(0), TP Shard(0)/Shard(1), FSDP over TP's _StridedShard(0), EP's
    Shard(0) of the experts, Replicate) leaves each rank a contiguous rectangle of the whole, which an offset and a
    shape describe; a Partial one would not hold values of the whole, so it is refused.
    """
    for placement in param.placements:
        if not isinstance(placement, Shard | _StridedShard | Replicate):
            raise NotImplementedError(f"cannot initialise a shard with placement {placement} in place")
    return compute_local_shape_and_global_offset(param.shape, param.device_mesh, param.placements)


@torch.no_grad()
def materialize_sharded(model: nn.Module, plain: nn.Module, seed: int, device) -> int:
    """Allocate `model` (parallelized, on the meta device) and fill this rank's shards with the weights one
    process would give it from `seed`; returns how many random numbers this rank drew.

    `plain` is the whole model unparallelized on the meta device (it costs nothing; a model whose plan keeps its
    parameter names, as a VLM's does, may be its own `plain`); its `init_specs` say how each parameter starts.
    Tensors already real (a VLM's pretrained vision tower, loaded from its folder) are kept; every meta one must
    have a spec. Each value is a function of (seed, name, row block) only (forge.models.common.init_spec), so a rank
    draws the row blocks its shard overlaps, on the CPU, and copies its columns into the local tensor: no
    collective (it works under a fake process group), host memory of one block beyond the shards, and about this
    rank's share of the random numbers. A pipeline stage fills the parameters it holds.
    """
    meta = {name for name, tensor in [*model.named_parameters(), *model.named_buffers()] if tensor.is_meta}
    allocate_meta_(model, device)
    model.tie_weights()  # to_empty re-created the shared embedding once per module
    model.init_buffers()
    specs = plain.init_specs()
    drawn = 0
    seen: set[int] = set()
    named = [*model.named_parameters(), *((n, b) for n, b in model.named_buffers() if plain_name(n) in specs)]
    for name, tensor in named:
        if id(tensor) in seen or name not in meta:
            continue
        seen.add(id(tensor))
        name = plain_name(name)
        if name not in specs:
            raise KeyError(f"no init spec for parameter {name!r}")
        if isinstance(tensor, DTensor):
            shape, offset = local_piece(tensor)
            local = tensor.to_local()
            if tuple(local.shape) != tuple(shape):
                raise RuntimeError(f"{name}: local shard {tuple(local.shape)} is not the expected {tuple(shape)}")
            drawn += fill_piece_(local, specs[name], seed, name, tuple(tensor.shape), offset)
        else:
            drawn += fill_piece_(tensor, specs[name], seed, name, tuple(tensor.shape), (0,) * tensor.dim())
    return drawn


def allocate_meta_(model: nn.Module, device: torch.device) -> None:
    """`to_empty` of each module that holds meta tensors of its own, children before parents (an FSDP module then
    re-registers its shards after their modules were allocated); modules whose tensors are real keep them."""
    for module in reversed(list(model.modules())):
        own = [t for t in [*module._parameters.values(), *module._buffers.values()] if t is not None]
        if any(t.is_meta for t in own):
            module.to_empty(device=device, recurse=False)
