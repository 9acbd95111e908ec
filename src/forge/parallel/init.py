"""Initial weights of a parallelized model, identical to a single process's with the same seed."""

import copy

import torch
from torch import nn
from torch.distributed.checkpoint.state_dict import StateDictOptions, set_model_state_dict
from torch.distributed.tensor import DTensor

from forge.model.transformer import unit_seed

# Wrappers that the plan adds around blocks; stripped to match the plain model's names.
_WRAPPER_PREFIXES = ("_checkpoint_wrapped_module.", "_orig_mod.")


def has_dtensor_parameters(model: nn.Module) -> bool:
    return any(isinstance(p, DTensor) for p in model.parameters())


def plain_name(name: str) -> str:
    for prefix in _WRAPPER_PREFIXES:
        name = name.replace(prefix, "")
    return name


def materialize_sharded(model: nn.Module, plain: nn.Module, seed: int, device) -> None:
    """Allocate `model` (parallelized, on the meta device) and fill this rank's shards with the weights one
    process would give it from `seed`, one initialisation unit at a time.

    `plain` is the same model unparallelized on the meta device (it costs nothing); each of its units (embedding,
    one block, norm, head: `init_parts`) in turn is made whole on `device`, initialised from its own seed, split
    into the model's layouts (any mix of FSDP and TP placements) and dropped. Memory peaks at the largest unit (the
    embedding of a large vocabulary, or one block) on top of the shards, not at the whole model; the values equal
    one process's on the same device type. A pipeline stage fills the units it holds.
    """
    model.to_empty(device=device)
    model.tie_weights()  # to_empty re-created the shared embedding once per module
    model.init_buffers()
    held = {name for name, _ in model.init_parts()}
    for name, unit in plain.init_parts():
        if name not in held:
            continue  # another pipeline stage's
        part = copy.deepcopy(unit).to_empty(device=device)  # on a GPU: fast, and one unit of device memory
        with torch.random.fork_rng(devices=[]):
            torch.manual_seed(unit_seed(seed, name))
            plain.init_part(name, part)
        state = {f"{name}.{key}": value for key, value in part.state_dict().items()}
        set_model_state_dict(model, state, options=StateDictOptions(full_state_dict=True, strict=False))
        del part, state
