"""The parallel plan of a vision-language model: data parallelism with FSDP2 (no TP/PP/EP for VLMs yet).

Each strategy names its FSDP units (`fsdp_units`): modules whose forward it calls, so each unshards when used.
A vision tower frozen for the whole run is left out of FSDP (every rank holds it whole, nothing to reduce);
one that the freeze schedule trains at some step is sharded like the rest.

Activation checkpointing recomputes each strategy's per-layer forward, `run_block`: MoT and MoMa call the parts of
the decoder's blocks (projections, FFNs, expert groups), never a block's own forward, so wrapping the blocks as the
text plan does would checkpoint nothing.
"""

import functools
import logging
from collections.abc import Callable

import torch
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.fsdp import fully_shard
from torch.utils.checkpoint import checkpoint

from forge.parallel.plan import checkpoint_options, fsdp_mesh

log = logging.getLogger("forge")


def parallelize_vlm(model: nn.Module, mesh: DeviceMesh | None, activation_checkpoint: str = "none") -> nn.Module:
    if activation_checkpoint != "none":
        checkpoint_layers(model, activation_checkpoint)
        log.info("activation checkpointing (%s) of each layer's run_block", activation_checkpoint)
    shard_mesh = fsdp_mesh(mesh)
    if shard_mesh is None:
        return model
    units = list(model.fsdp_units())
    ignored = None
    if model.train_encoder_from_step is None:
        ignored = set(model.encoder.parameters())
    else:
        units.append(model.encoder)
    for unit in units:
        fully_shard(unit, mesh=shard_mesh)
    fully_shard(model, mesh=shard_mesh, ignored_params=ignored)
    frozen = "replicated (frozen)" if ignored else "sharded (trained by the schedule)"
    log.info("FSDP over %d ranks: %d units and the root; vision tower %s", shard_mesh.size(), len(units), frozen)
    return model


def checkpoint_layers(model: nn.Module, mode: str) -> None:
    """Swap the model's class for a subclass whose `run_block` is recomputed in backward (`full`), or all but its
    matmuls and attention (`selective`), and runs plainly under no_grad (evaluation, generation). A subclass, as
    FSDP2 does, rather than a function on the instance: a deepcopy then still runs its own layers."""
    cls = type(model)
    model.__class__ = type(f"Checkpointed{cls.__name__}", (cls,), {"run_block": checkpointed(cls.run_block, mode)})


def checkpointed(layer: Callable, mode: str) -> Callable:
    """The method `layer` under activation checkpointing (see checkpoint_layers)."""
    options = checkpoint_options(mode)

    @functools.wraps(layer)
    def run(self, *args, **kwargs):
        if not torch.is_grad_enabled():
            return layer(self, *args, **kwargs)
        return checkpoint(layer, self, *args, use_reentrant=False, **options, **kwargs)

    return run
