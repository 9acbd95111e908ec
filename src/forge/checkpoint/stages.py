"""Checkpoint keys of pipeline stages: always the whole model's parameter names.

A pipeline stage is the model with the blocks it does not own deleted (forge.parallel.pipeline), so its parameter
names are already the whole model's, but it holds only some of them. A rank with two stages (interleaved 1F1B)
trains them as an nn.ModuleList, which prefixes each name with the stage's position in the list ("1.layers.3...").
Checkpoints store the unprefixed names, so a checkpoint written by any layout reads into any other.
"""

import torch
from torch import nn

from forge.models.spec import spec_of


def whole_model_keys(model: nn.Module) -> set[str] | None:
    """Every state-dict key of the whole model when `model` holds only part of it (pipeline stages), else None."""
    parts = list(model) if isinstance(model, nn.ModuleList) else [model]
    first = parts[0]
    args = getattr(first, "args", None)
    if args is None or not hasattr(first, "layers"):  # a VLM is whole
        return None
    whole = len(parts) == 1 and len(first.layers) == args.n_layers
    if whole and first.tok_embeddings is not None and first.output is not None:
        return None
    with torch.device("meta"):
        return set(spec_of(args).build(args).state_dict())


def whole_model_names(model: nn.Module, model_sd: dict) -> dict[str, str]:
    """{local key: whole-model key} for the keys `get_state_dict` gives for `model`; empty when they are equal."""
    if not isinstance(model, nn.ModuleList):
        return {}
    return {key: key.partition(".")[2] for key in model_sd if key.partition(".")[0].isdigit()}


def rename(model_sd: dict, optim_sd: dict | None, names: dict[str, str]) -> tuple[dict, dict | None]:
    """`get_state_dict`'s model and optimizer state dicts with their keys renamed by `names` (others kept)."""
    if not names:
        return model_sd, optim_sd
    model_sd = {names.get(key, key): value for key, value in model_sd.items()}
    if optim_sd is None:
        return model_sd, None
    optim_sd = {
        "state": {names.get(key, key): value for key, value in optim_sd["state"].items()},
        "param_groups": [
            {**group, "params": [names.get(key, key) for key in group["params"]]} for group in optim_sd["param_groups"]
        ],
    }
    return model_sd, optim_sd
