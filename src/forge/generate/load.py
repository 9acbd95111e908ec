"""A trained model with the tokenizer and data config it was trained with, from any checkpoint layout."""

from dataclasses import dataclass
from pathlib import Path

import torch
from hydra.utils import instantiate
from omegaconf import DictConfig
from tokenizers import Tokenizer
from torch import nn

from forge.checkpoint.convert import load_pretrained
from forge.checkpoint.errors import CheckpointError
from forge.checkpoint.layout import resolve_checkpoint
from forge.checkpoint.run_config import load_run_config
from forge.data.tokenizer import eos_id_of, load_tokenizer


@dataclass
class Loaded:
    model: nn.Module
    run_config: DictConfig | None
    """The composed config the checkpoint was written with (None for HF folders and consolidated files)."""


def run_config_of(source: str | Path) -> DictConfig | None:
    """The checkpoint's config.yaml (the run's composed config), when the source is a run or DCP checkpoint; a
    `_target_` in it that is not forge's own is refused (see forge.checkpoint.run_config)."""
    src = Path(source).expanduser()
    if not src.is_dir() or (src / "config.json").is_file():
        return None
    config_file = resolve_checkpoint(src) / "config.yaml"
    return load_run_config(config_file) if config_file.is_file() else None


def load(source: str | Path, device: torch.device) -> Loaded:
    return Loaded(load_pretrained(source).to(device), run_config_of(source))


def build_corpus(data: DictConfig):
    """The corpus object of a `data` config (tokenizer, eos_id, val_tokens)."""
    return instantiate(data)


def tokenizer_of(source: str | Path, run_config: DictConfig | None, name: str | None = None) -> tuple[Tokenizer, int]:
    """(tokenizer, eos id): `name` if given, else the run's data tokenizer, else an HF folder's own files."""
    src = Path(source).expanduser()
    if name:
        tokenizer = load_tokenizer(name)
    elif run_config is not None and "data" in run_config:
        corpus = build_corpus(run_config.data)
        return corpus.tokenizer, corpus.eos_id
    elif src.is_dir() and (src / "tokenizer.json").is_file():
        tokenizer = load_tokenizer(str(src))
    else:
        raise CheckpointError(f"{src} carries no tokenizer or run config; pass tokenizer=gpt2|FILE|FOLDER")
    return tokenizer, eos_id_of(tokenizer)
