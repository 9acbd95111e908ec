"""Vision towers from Hugging Face transformers, loaded with from_pretrained(folder), and a tiny local one.

Any folder `AutoModel.from_pretrained` reads works: a CLIPVisionModel or SiglipVisionModel, or a full CLIP/SigLIP
model (its vision half is taken). No weights come from a hub here: `build_tiny_encoder` writes a small encoder,
built from a config with seeded random weights plus its image processor, to a local folder, and everything loads
it back through the same from_pretrained path a user's real checkpoint takes.
"""

import os
from pathlib import Path

import torch
from torch import nn

from forge.files import temp_dir

TINY_ENCODERS = ("clip", "siglip")


def build_tiny_encoder(folder: str | Path, kind: str = "clip", image_size: int = 64, seed: int = 0) -> Path:
    """Write a small `kind` vision encoder and its image processor to `folder` (atomically); return the folder."""
    from transformers import (
        CLIPImageProcessor,
        CLIPVisionConfig,
        CLIPVisionModel,
        SiglipImageProcessor,
        SiglipVisionConfig,
        SiglipVisionModel,
    )

    folder = Path(folder)
    if (folder / "config.json").is_file():
        return folder
    if kind not in TINY_ENCODERS:
        raise ValueError(f"vlm.encoder_kind={kind!r} is not one of {', '.join(TINY_ENCODERS)}")
    shape = dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4)
    shape |= dict(image_size=image_size, patch_size=16)
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        if kind == "clip":
            model = CLIPVisionModel(CLIPVisionConfig(**shape))
            processor = CLIPImageProcessor(
                size={"shortest_edge": image_size}, crop_size={"height": image_size, "width": image_size}
            )
        else:
            model = SiglipVisionModel(SiglipVisionConfig(**shape))
            processor = SiglipImageProcessor(size={"height": image_size, "width": image_size})
    folder.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(temp_dir(folder.parent, prefix=f".{folder.name}-"))
    model.save_pretrained(tmp)
    processor.save_pretrained(tmp)
    try:
        os.replace(tmp, folder)
    except OSError:  # another process won the race; its folder is equally good
        if not (folder / "config.json").is_file():
            raise
    return folder


def load_vision_tower(path: str | Path) -> nn.Module:
    """The vision model in a transformers folder (a full CLIP/SigLIP model gives its vision half)."""
    from transformers import AutoModel

    folder = Path(path).expanduser()
    if not (folder / "config.json").is_file():
        raise FileNotFoundError(f"vlm.encoder_path={str(path)!r} is not a transformers model folder (no config.json)")
    model = AutoModel.from_pretrained(str(folder))
    return getattr(model, "vision_model", model)


class VisionTower(nn.Module):
    """A transformers vision model as (images) -> patch features (images, tokens, width)."""

    def __init__(self, model: nn.Module):
        super().__init__()
        self.model = model
        config = getattr(model, "config", None)
        self.width = int(config.hidden_size)

    def forward(self, pixels: torch.Tensor) -> torch.Tensor:
        return self.model(pixel_values=pixels).last_hidden_state
