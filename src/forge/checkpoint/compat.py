"""Check a checkpoint's keys and shapes against the model before loading anything."""

from pathlib import Path

import torch
from torch.distributed.checkpoint.metadata import TensorStorageMetadata

from forge.checkpoint.errors import CheckpointError
from forge.checkpoint.untrusted import read_metadata


def check_model_keys(
    path: Path,
    model_state: dict,
    prefix: str = "model.",
    exclude: tuple[str, ...] = (),
    whole_keys: set[str] | None = None,
) -> None:
    """Raise CheckpointError naming the first missing, unexpected or mis-shaped key.

    `whole_keys`: every key of the whole model when `model_state` is only part of it (a pipeline stage); stored
    keys outside it are unexpected, those of the other stages are not.
    """
    stored = {
        key[len(prefix) :]: meta
        for key, meta in read_metadata(path).state_dict_metadata.items()
        if key.startswith(prefix)
    }
    wanted = {k: v for k, v in model_state.items() if not k.startswith(exclude)}
    missing = sorted(set(wanted) - set(stored))
    if missing:
        raise CheckpointError(f"checkpoint {path} lacks model key '{missing[0]}' ({len(missing)} missing in all)")
    known = set(model_state) if whole_keys is None else whole_keys
    unexpected = sorted(k for k in set(stored) - known if not k.startswith(exclude))
    if unexpected:
        raise CheckpointError(
            f"checkpoint {path} has model key '{unexpected[0]}' that this model does not "
            f"({len(unexpected)} unexpected in all)"
        )
    for key, value in wanted.items():
        meta = stored[key]
        shape_differs = isinstance(meta, TensorStorageMetadata) and tuple(meta.size) != tuple(value.shape)
        if isinstance(value, torch.Tensor) and shape_differs:
            raise CheckpointError(
                f"checkpoint {path} key '{key}' has shape {tuple(meta.size)}, the model expects {tuple(value.shape)}"
            )
