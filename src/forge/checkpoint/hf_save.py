"""Write a (parallelized) model as a Hugging Face folder, one gathered tensor at a time.

Rank 0 writes model.safetensors' header first, from the whole model's shapes, then each tensor's bytes as soon as
it has it: every rank holding a weight gathers it (DTensor.full_tensor over its shards), and a pipeline stage's
first holder sends it to rank 0. So no rank holds more than one whole tensor beyond its own shards (for MoE, one
layer's stacked experts), never the whole state dict. Names and the config are the family's adapter's
(forge.models.spec.HFAdapter); the folder is written under a staging name and renamed into place when whole.
"""

import json
import logging
import os
import shutil
from pathlib import Path

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.checkpoint.state_dict import get_model_state_dict
from torch.distributed.tensor import DTensor

from forge.checkpoint.hf import hf_adapter, whole_shapes
from forge.checkpoint.hf_load import decoder_args
from forge.checkpoint.stages import whole_model_names
from forge.config.schema import CheckpointConfig
from forge.parallel.init import plain_name

log = logging.getLogger("forge")

WEIGHTS = "model.safetensors"


def _rank() -> int:
    return dist.get_rank() if dist.is_initialized() else 0


def _header(entries: list[tuple[str, tuple[int, ...]]]) -> bytes:
    """A safetensors header for fp32 tensors stored back to back in `entries` order."""
    header: dict = {"__metadata__": {"format": "pt"}}
    offset = 0
    for name, shape in entries:
        size = 4 * torch.Size(shape).numel()
        header[name] = {"dtype": "F32", "shape": list(shape), "data_offsets": [offset, offset + size]}
        offset += size
    raw = json.dumps(header, separators=(",", ":")).encode()
    raw += b" " * (-len(raw) % 8)  # the data starts 8-byte aligned
    return len(raw).to_bytes(8, "little") + raw


def _holders(names: set[str]) -> list[set[str]]:
    """Every rank's set of whole-model keys (pipeline stages hold different ones)."""
    if not dist.is_initialized():
        return [names]
    out: list = [None] * dist.get_world_size()
    dist.all_gather_object(out, names)
    return out


def _whole_tensor(key: str, mine: dict, holders: list[set[str]], shape: torch.Size) -> torch.Tensor | None:
    """The whole fp32 tensor of `key` on rank 0 (None elsewhere). Collective among the ranks that hold it."""
    value = mine.get(key)
    if value is not None:
        value = value.full_tensor() if isinstance(value, DTensor) else value
        value = value.detach().to(torch.float32)
    rank, owner = _rank(), next(r for r, names in enumerate(holders) if key in names)
    if owner == 0 or rank not in (0, owner):
        return value if rank == 0 else None
    if rank == owner:  # another pipeline stage's weight: its first holder sends it
        dist.send(value.contiguous(), dst=0)
        return None
    received = torch.empty(shape, dtype=torch.float32, device=_device(mine))
    dist.recv(received, src=owner)
    return received


def _device(state: dict) -> torch.device:
    return next(iter(state.values())).device


def _write(file, tensor: torch.Tensor, key: str, adapter, args) -> None:
    for part in adapter.to_hf(key, tensor.cpu(), args):
        file.write(part.contiguous().numpy().data)  # no copy beyond the contiguous one


def save_hf_from(model: nn.Module, folder: str | Path, tokenizer=None) -> Path:
    """Write `model` (any parallel layout) as config.json + model.safetensors (+ the tokenizer, a `tokenizers`
    Tokenizer, when given) under `folder`, replacing it. Collective: every rank calls it."""
    folder = Path(folder).expanduser()
    args = decoder_args(model)
    adapter = hf_adapter(args)
    config = adapter.args_to_config(args)  # raises before anything is written for a model HF cannot express
    local = get_model_state_dict(model)
    names = whole_model_names(model, local)
    mine = {plain_name(names.get(key, key)): value for key, value in local.items()}
    whole = whole_shapes(args)
    holders = _holders(set(mine) & set(whole))
    staging = folder.parent / f".{folder.name}.staging-{os.getpid()}"
    file = None
    if _rank() == 0:
        shutil.rmtree(staging, ignore_errors=True)
        staging.mkdir(parents=True)
        entries = [entry for key, shape in whole.items() for entry in adapter.entries(key, tuple(shape), args)]
        file = open(staging / WEIGHTS, "wb")  # noqa: SIM115 - written across the gather loop below
        file.write(_header(entries))
    try:
        for key, shape in whole.items():
            tensor = _whole_tensor(key, mine, holders, shape)
            if tensor is not None:
                _write(file, tensor, key, adapter, args)
            del tensor
    finally:
        if file is not None:
            file.close()
    if _rank() == 0:
        (staging / "config.json").write_text(json.dumps(config, indent=2))
        if tokenizer is not None:
            _save_tokenizer(tokenizer, staging)
        _replace(staging, folder)
        log.info("Hugging Face export: %s", folder)
    if dist.is_initialized():
        dist.barrier()
    return folder


def _save_tokenizer(tokenizer, folder: Path) -> None:
    from transformers import PreTrainedTokenizerFast

    from forge.data.tokenizer import EOS

    PreTrainedTokenizerFast(tokenizer_object=tokenizer, eos_token=EOS).save_pretrained(folder)


def _replace(staging: Path, folder: Path) -> None:
    old = folder.parent / f".{folder.name}.replaced-{os.getpid()}"
    if folder.exists():
        os.replace(folder, old)
    os.replace(staging, folder)
    shutil.rmtree(old, ignore_errors=True)


def hf_export_dir(cfg: CheckpointConfig, run_dir: Path) -> Path:
    """checkpoint.hf_dir, relative to the run directory unless absolute."""
    path = Path(cfg.hf_dir).expanduser()
    return path if path.is_absolute() else Path(run_dir) / path


def save_run_hf(cfg: CheckpointConfig, run_dir: Path, model: nn.Module, tokenizer=None) -> Path | None:
    """The end of a run: the final weights as a Hugging Face folder when checkpoint.save_hf is set (`cfg` is the
    checkpoint config). Collective."""
    if not cfg.save_hf:
        return None
    return save_hf_from(model, hf_export_dir(cfg, run_dir), tokenizer)
