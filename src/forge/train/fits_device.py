"""Whether a run's model can be held at all on the device it runs on: refused with the estimate before anything is
allocated, not found by an out-of-memory kill once the weights are made."""

import os

import torch
from omegaconf import DictConfig

from forge.config.degrees import Degrees
from forge.config.errors import ConfigError

GIB = 2**30
STATE_BYTES_PER_PARAM = 12
"""The least a trained parameter holds: fp32 weight, fp32 gradient and one fp32 optimizer state (AdamW keeps two;
activations come on top): a lower bound, so a refusal is certain to be right."""


def device_memory_bytes(device: torch.device) -> tuple[int, str]:
    """The memory one rank can count on and its name: a GPU's own, or the host's RAM divided among the ranks that
    share this host."""
    if device.type == "cuda":
        index = device.index if device.index is not None else int(os.environ.get("LOCAL_RANK", 0))
        return torch.cuda.get_device_properties(index).total_memory, f"GPU {torch.cuda.get_device_name(index)}"
    total = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    local = int(os.environ.get("LOCAL_WORLD_SIZE") or os.environ.get("SLURM_NTASKS_PER_NODE") or 1)
    if local > 1:
        return total // local, f"host's {total / GIB:.1f} GiB RAM shared by {local} local ranks"
    return total, "host's RAM"


def check_fits_device(cfg: DictConfig, degrees: Degrees, device: torch.device) -> None:
    """Refuse a text model whose parameters alone (STATE_BYTES_PER_PARAM each, split over the ranks that shard
    them) exceed the memory of one rank's device. Counted on the meta device: nothing is allocated."""
    if cfg.get("vlm") is not None:
        return  # the vision tower comes from its folder; the decoders are small next to a host's memory
    from forge.train.build import build_meta_model

    params = sum(p.numel() for p in build_meta_model(cfg).parameters())
    shards = max(degrees.world_size // degrees.dp_replicate, 1)
    weights = STATE_BYTES_PER_PARAM * params / shards
    activations = block_inputs_bytes(cfg, degrees)
    have, what = device_memory_bytes(device)
    if weights + activations > have:
        raise ConfigError(
            f"the run needs at least {(weights + activations) / GIB:,.1f} GiB per rank, more than the "
            f"{have / GIB:,.1f} GiB of this {what}: the model's {params:,} parameters {weights / GIB:,.1f} GiB (fp32 "
            f"weights, gradients and one optimizer state, {STATE_BYTES_PER_PARAM} bytes each, over {shards} "
            f"rank(s)) and each block's input kept for the backward {activations / GIB:,.1f} GiB "
            f"(train.micro_batch_size={cfg.train.micro_batch_size} x train.seq_len={cfg.train.seq_len} x "
            f"model.dim={cfg.model.dim} x model.n_layers={cfg.model.n_layers}); forge-train --plan estimates a "
            "layout's peak"
        )


def block_inputs_bytes(cfg: DictConfig, degrees: Degrees) -> float:
    """What a training step keeps at the least, even under full activation checkpointing: each block's input (2
    bytes an element), split over the ranks that split the sequence, the width or the blocks."""
    train, model = cfg.train, cfg.model
    elements = train.micro_batch_size * train.seq_len * model.dim * model.n_layers
    return 2 * elements / (degrees.cp * degrees.tp * degrees.pp)
