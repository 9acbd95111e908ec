"""The parallel plan of a vision-language model: data parallelism with FSDP2 (no TP/PP/EP for VLMs yet), with the
text plan's mixed precision (bf16 gathers and fp32 reductions under train.dtype=bf16).

Each strategy names its FSDP units (`fsdp_units`): modules whose forward it calls, so each unshards when used.
A vision tower frozen for the whole run is left out of FSDP (every rank holds it whole, nothing to reduce);
one that the freeze schedule trains at some step is sharded like the rest.

Activation checkpointing recomputes each strategy's per-layer forward, `run_block`: MoT and MoMa call the parts of
the decoder's blocks (projections, FFNs, expert groups), never a block's own forward, so wrapping the blocks as the
text plan does would checkpoint nothing.
"""

import dataclasses
import functools
from collections.abc import Callable

import torch
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard
from torch.utils.checkpoint import checkpoint

from forge.parallel.applied import Applied, logged
from forge.parallel.plan import checkpoint_options, fsdp_mesh, mesh_dims, policy_dtypes


def parallelize_vlm(
    model: nn.Module,
    mesh: DeviceMesh | None,
    activation_checkpoint: str = "none",
    policy: MixedPrecisionPolicy | None = None,
) -> nn.Module:
    """Apply the VLM plan to `model` in place and return the model (apply_vlm_plan returns what it applied)."""
    apply_vlm_plan(model, mesh, activation_checkpoint, policy)
    return model


def apply_vlm_plan(
    model: nn.Module,
    mesh: DeviceMesh | None,
    activation_checkpoint: str = "none",
    policy: MixedPrecisionPolicy | None = None,
) -> list[Applied]:
    """Activation checkpointing of each layer's run_block, then FSDP2 with `policy` (forge.parallel.plan's
    mixed_precision_policy; None: fp32), applied to `model` in place; mesh is None for one process. Returns what
    was applied, in order."""
    applied = []
    if activation_checkpoint != "none":
        applied.append(checkpoint_layers(model, activation_checkpoint))
    shard_mesh = fsdp_mesh(mesh)
    if shard_mesh is not None:
        applied.append(apply_vlm_fsdp(model, shard_mesh, policy or MixedPrecisionPolicy()))
    return applied


def apply_vlm_fsdp(model: nn.Module, shard_mesh: DeviceMesh, policy: MixedPrecisionPolicy) -> Applied:
    """FSDP2 of each unit the strategy names, then the root; the vision tower is one more unit when the schedule
    trains it, and stays whole on every rank when it is frozen for the run.

    Units gather in the policy's parameter dtype and cast their floating inputs to it (a trained tower, a unit,
    its pixels). The root does not cast its inputs: a frozen tower is not FSDP's, keeps its own dtype and reads
    the pixels as the data gives them, and autocast decides what its matmuls run in."""
    units = list(model.fsdp_units())
    ignored = None
    if model.train_encoder_from_step is None:
        ignored = set(model.encoder.parameters())
    else:
        units.append(model.encoder)
    for unit in units:
        fully_shard(unit, mesh=shard_mesh, mp_policy=policy)
    root = dataclasses.replace(policy, cast_forward_inputs=False)
    fully_shard(model, mesh=shard_mesh, ignored_params=ignored, mp_policy=root)
    frozen = "replicated (frozen)" if ignored else "sharded (trained by the schedule)"
    detail = f"FSDP over {shard_mesh.size()} ranks: {len(units)} units and the root ({policy_dtypes(policy)}); "
    detail += f"vision tower {frozen}"
    return logged(Applied("fsdp", detail, mesh_dims(shard_mesh)))


def checkpoint_layers(model: nn.Module, mode: str) -> Applied:
    """Swap the model's class for a subclass whose `run_block` is recomputed in backward (`full`), or all but its
    matmuls and attention (`selective`), and runs plainly under no_grad (evaluation, generation). A subclass, as
    FSDP2 does, rather than a function on the instance: a deepcopy then still runs its own layers."""
    cls = type(model)
    model.__class__ = type(f"Checkpointed{cls.__name__}", (cls,), {"run_block": checkpointed(cls.run_block, mode)})
    return logged(Applied("activation_checkpoint", f"activation checkpointing ({mode}) of each layer's run_block"))


def checkpointed(layer: Callable, mode: str) -> Callable:
    """The method `layer` under activation checkpointing (see checkpoint_layers)."""
    options = checkpoint_options(mode)

    @functools.wraps(layer)
    def run(self, *args, **kwargs):
        if not torch.is_grad_enabled():
            return layer(self, *args, **kwargs)
        return checkpoint(layer, self, *args, use_reentrant=False, **options, **kwargs)

    return run
