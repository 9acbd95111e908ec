"""A small CLIP and SigLIP vision tower saved to local folders, and tiny text-model arguments."""

import pytest
import torch

from forge.models.llama.args import TransformerArgs
from forge.models.vlm.encoder import build_tiny_encoder


@pytest.fixture(scope="session")
def encoders(tmp_path_factory) -> dict[str, str]:
    root = tmp_path_factory.mktemp("encoders")
    return {kind: str(build_tiny_encoder(root / kind, kind)) for kind in ("clip", "siglip")}


@pytest.fixture
def text_args() -> TransformerArgs:
    return TransformerArgs(dim=64, n_layers=4, n_heads=4, n_kv_heads=2, vocab_size=97, ffn_dim=128, max_seq_len=256)


def media(batch: int = 2, frames: int = 3, valid: int = 2, seed: int = 0):
    """Random pixels for `frames` frames per sample of which the first `valid` are real."""
    gen = torch.Generator().manual_seed(seed)
    pixels = torch.randn(batch, frames, 3, 64, 64, generator=gen)
    mask = torch.zeros(batch, frames, dtype=torch.bool)
    mask[:, :valid] = True
    times = torch.arange(frames, dtype=torch.float32).expand(batch, frames) * 0.5
    tokens = torch.randint(0, 97, (batch, 12), generator=gen)
    return tokens, pixels, mask, times
