"""Initial weights of a parallelized model, identical to a single process's with the same seed."""

from collections.abc import Callable

import torch
from torch import nn
from torch.distributed.checkpoint.state_dict import StateDictOptions, set_model_state_dict
from torch.distributed.tensor import DTensor

# Wrappers that the plan adds around blocks; stripped to match the plain model's names.
_WRAPPER_PREFIXES = ("_checkpoint_wrapped_module.", "_orig_mod.")


def has_dtensor_parameters(model: nn.Module) -> bool:
    return any(isinstance(p, DTensor) for p in model.parameters())


def plain_name(name: str) -> str:
    for prefix in _WRAPPER_PREFIXES:
        name = name.replace(prefix, "")
    return name


def materialize_from_reference(model: nn.Module, build_reference: Callable[[], nn.Module], device) -> None:
    """Allocate `model` (sharded, on the meta device) and copy in this rank's part of a full reference model.

    `build_reference` builds and initialises the whole model on the CPU exactly as a single process would; its
    tensors are split into the model's DTensor layouts (any mix of FSDP and TP placements). It costs one full
    copy of the model in host memory per rank while it runs, which suits the model sizes tested on CPU; very
    large models should instead initialise DTensors directly with torch.distributed.tensor's RNG.
    """
    model.to_empty(device=device)
    if hasattr(model, "tie_weights"):
        model.tie_weights()  # to_empty re-created the shared embedding once per module
    reference = build_reference()
    set_model_state_dict(model, reference.state_dict(), options=StateDictOptions(full_state_dict=True))
    buffers = {plain_name(name): buf for name, buf in reference.named_buffers()}
    with torch.no_grad():
        for name, buf in model.named_buffers():
            buf.copy_(buffers[plain_name(name)].to(buf.device))
