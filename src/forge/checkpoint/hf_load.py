"""Warm start from a Hugging Face folder (any family with an adapter: Llama, Qwen3, Mixtral, Qwen3-MoE, DeepSeek-V3,
GPT-2, ...) straight into a parallelized model.

Each rank reads only the box of every weight it holds (FSDP and TP shards, expert-parallel slices, the blocks of
its pipeline stages) with safetensors' `get_slice` on the memory-mapped files, and hands the model one unit
(embedding, one block, norm, head) at a time: no rank reads a tensor it does not hold or builds the whole state
dict. Which tensors of the folder make a box of ours is the family's adapter's (forge.models.spec.HFAdapter.read).
"""

import logging
from contextlib import ExitStack
from pathlib import Path

import torch
from torch import nn
from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict, set_model_state_dict
from torch.distributed.tensor import DTensor
from torch.distributed.tensor._utils import compute_local_shape_and_global_offset

from forge.checkpoint.errors import CheckpointError
from forge.checkpoint.hf import HFWeights, hf_adapter, read_hf_config
from forge.checkpoint.stages import whole_model_keys, whole_model_names
from forge.models.spec import spec_of
from forge.parallel.init import plain_name

log = logging.getLogger("forge")

INDEX = "model.safetensors.index.json"
_IGNORED_SUFFIXES = ("rotary_emb.inv_freq",)  # a buffer that old Llama exports saved; recomputed from rope_theta
_BYTES = {"F64": 8, "F32": 4, "F16": 2, "BF16": 2, "I64": 8, "I32": 4, "I16": 2, "I8": 1, "U8": 1, "BOOL": 1}


def is_hf_folder(source: str | Path) -> bool:
    """A Hugging Face model folder (config.json beside the weights), not a forge run or DCP checkpoint."""
    path = Path(source).expanduser()
    forge_layout = (path / "checkpoints").is_dir() or (path / ".metadata").is_file()
    return path.is_dir() and (path / "config.json").is_file() and not forge_layout


def decoder_args(model: nn.Module):
    """The args of the text decoder `model` is (or whose pipeline stages it holds); CheckpointError otherwise (a
    VLM, whose parts have their own formats)."""
    first = model[0] if isinstance(model, nn.ModuleList) else model
    args = getattr(first, "args", None)
    if args is None or not hasattr(args, "n_layers"):
        raise CheckpointError(f"Hugging Face weights fit forge's text decoders only, not a {type(first).__name__}")
    return args


def check_hf_config(folder: Path, args) -> None:
    """config.json describes the model of `args`: CheckpointError naming the first field that differs (the
    family's adapter compares); fields a warm start may change on purpose are a warning."""
    config_file = folder / "config.json"
    theirs = read_hf_config(config_file)
    if spec_of(theirs) is not spec_of(args):
        raise CheckpointError(
            f"{config_file} holds a {spec_of(theirs).name} model, but model._target_ builds a {spec_of(args).name} one"
        )
    adapter = hf_adapter(args)
    adapter.check_config(theirs, args, config_file)
    for name in getattr(adapter, "soft_fields", ()):
        if getattr(args, name) != getattr(theirs, name):
            log.warning(
                "%s has another %s (%s) than model.%s=%s: loading anyway",
                config_file,
                name,
                getattr(theirs, name),
                name,
                getattr(args, name),
            )


def _box(value: torch.Tensor) -> tuple[tuple[int, ...], tuple[slice, ...]]:
    """(global shape, the slices of it this rank holds)."""
    if not isinstance(value, DTensor):
        return tuple(value.shape), tuple(slice(0, n) for n in value.shape)
    shape, offset = compute_local_shape_and_global_offset(value.shape, value.device_mesh, value.placements)
    if tuple(shape) != tuple(value.to_local().shape):  # a layout whose local part is not one box of the whole
        raise CheckpointError(f"cannot tell which part of the tensor this rank holds (placements {value.placements})")
    return tuple(value.shape), tuple(slice(o, o + n) for o, n in zip(offset, shape, strict=True))


def _read(weights: HFWeights, key: str, value: torch.Tensor, args) -> torch.Tensor:
    """This rank's part of our `key` from the HF tensors (the family's adapter says which), in `value`'s dtype and
    device."""
    shape, box = _box(value)
    local = hf_adapter(args).read(key, shape, box, weights, args).to(device=value.device, dtype=value.dtype)
    if not isinstance(value, DTensor):
        return local
    return DTensor.from_local(local, value.device_mesh, value.placements, shape=value.shape, stride=value.stride())


def _unit(key: str) -> str:
    parts = key.split(".")
    return ".".join(parts[:2]) if parts[0] == "layers" else parts[0]


def _check_keys(weights: HFWeights, wanted: set[str], known: set[str], exclude: tuple[str, ...], args) -> None:
    """Every wanted key has its tensors in the folder, and the folder holds nothing this model lacks."""
    provided = hf_adapter(args).our_keys(set(weights.files), args)
    missing = sorted(wanted - provided)
    if missing:
        raise CheckpointError(
            f"{weights.folder} has no weights for '{missing[0]}' ({len(missing)} model keys missing in all; "
            "checkpoint.load_weights_exclude leaves keys at their initial values)"
        )
    unexpected = sorted(k for k in provided - known if not k.startswith(exclude))
    if unexpected:
        raise CheckpointError(f"{weights.folder} has weights for '{unexpected[0]}', which this model does not have")


def load_hf_into(model: nn.Module, folder: str | Path, exclude: tuple[str, ...] = ()) -> int:
    """Fill `model` (parallelized or not) with the weights of a Hugging Face folder, keys starting with an `exclude`
    prefix left as they are. Every rank calls it (no collective runs); returns the bytes this rank read."""
    folder = Path(folder).expanduser()
    args = decoder_args(model)
    check_hf_config(folder, args)
    local = get_model_state_dict(model)
    names = whole_model_names(model, local)
    whole = {key: plain_name(names.get(key, key)) for key in local}
    known = whole_model_keys(model) or set(whole.values())
    if args.tie_embeddings:  # one parameter under two names: it is read as the embedding
        whole = {key: name for key, name in whole.items() if name != "output.weight"}
    wanted = {key: name for key, name in whole.items() if not name.startswith(exclude)}
    with ExitStack() as stack:
        weights = HFWeights(folder, stack)
        _check_keys(weights, set(wanted.values()), known, exclude, args)
        unit, batch = None, {}
        for key, name in wanted.items():
            if _unit(name) != unit and batch:
                set_model_state_dict(model, batch, options=StateDictOptions(strict=False))
                batch = {}
            unit = _unit(name)
            batch[key] = _read(weights, name, local[key], args)
        if batch:
            set_model_state_dict(model, batch, options=StateDictOptions(strict=False))
        total = weights.total_bytes
    log.info(
        "warm start: weights from the Hugging Face folder %s (this rank read %.1f MB of the folder's %.1f MB)",
        folder,
        weights.bytes_read / 1e6,
        total / 1e6,
    )
    return weights.bytes_read
