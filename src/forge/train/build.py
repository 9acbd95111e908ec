"""Builders for the pieces of a run, each from its config group."""

import logging

import torch
from hydra.utils import instantiate
from omegaconf import DictConfig, OmegaConf
from torch import nn

from forge.data.loader import BatchLoader, TokenWindows
from forge.model import Transformer, TransformerArgs
from forge.train.optim import param_groups

log = logging.getLogger("forge")


def resolve_device(name: str) -> torch.device:
    if name == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    return torch.device(name)


def model_args(cfg: DictConfig) -> TransformerArgs:
    return instantiate(cfg.model, _convert_="all")


def build_meta_model(cfg: DictConfig) -> Transformer:
    """The model on the meta device: shapes only, nothing allocated (the parallel plan applies here)."""
    with torch.device("meta"):
        return Transformer(model_args(cfg))


def materialize(model: nn.Module, device: torch.device, seed: int) -> None:
    """Allocate a meta-device model on `device` and initialise it reproducibly from `seed`."""
    model.to_empty(device=device)
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        model.init_weights()


def build_optimizer(cfg: DictConfig, model: nn.Module):
    optimizer = instantiate(cfg.optimizer)(param_groups(model))
    scheduler = instantiate(cfg.scheduler)(optimizer)
    return optimizer, scheduler


def build_corpus(cfg: DictConfig):
    return instantiate(cfg.data)


def build_loader(cfg: DictConfig, tokens, dp_rank: int, dp_size: int) -> BatchLoader:
    windows = TokenWindows(tokens, cfg.train.seq_len)
    return BatchLoader(windows, cfg.train.micro_batch_size, cfg.train.seed, dp_rank, dp_size)


def config_yaml(cfg: DictConfig) -> str:
    return OmegaConf.to_yaml(cfg, resolve=True)
