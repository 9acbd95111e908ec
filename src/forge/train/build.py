"""Builders for the pieces of a run, each from its config group."""

import logging
from typing import TYPE_CHECKING

import torch
from hydra.utils import instantiate
from omegaconf import DictConfig, OmegaConf
from torch import nn

from forge.data import Corpus, Loader
from forge.models.spec import spec_of
from forge.train.optim import param_groups

if TYPE_CHECKING:
    from forge.config.schema import TrainConfig

log = logging.getLogger("forge")


def resolve_device(name: str) -> torch.device:
    if name == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    return torch.device(name)


def model_args(cfg: DictConfig):
    """The model's arguments: the dataclass of its family that model._target_ names."""
    return instantiate(cfg.model, _convert_="all")


def build_meta_model(cfg: DictConfig) -> nn.Module:
    """The model on the meta device, built by its family (forge.models.spec): shapes only, nothing allocated (the
    parallel plan applies here)."""
    args = model_args(cfg)
    with torch.device("meta"):
        return spec_of(args).build(args)


def materialize(model: nn.Module, device: torch.device, seed: int) -> None:
    """Allocate a meta-device model on `device` and initialise it reproducibly from `seed`."""
    model.to_empty(device=device)
    model.init_weights(seed=seed)


def build_optimizer(cfg: DictConfig, model: nn.Module):
    """The optimizer and its schedule. The optimizer is called with param_groups(model), or with the model itself
    when its schema says `takes_model` (Muon, which tells the head from hidden matrices by name)."""
    make = instantiate(cfg.optimizer, _convert_="all")  # plain lists: the state is saved and read weights_only
    takes_model = getattr(OmegaConf.get_type(cfg.optimizer), "takes_model", False)
    optimizer = make(model if takes_model else param_groups(model))
    scheduler = instantiate(cfg.scheduler)(optimizer)
    return optimizer, scheduler


def build_loss(cfg: DictConfig):
    """The training loss (conf/loss); plain cross-entropy when the config has no loss group. Under
    parallel.compile a loss that can (CrossEntropyLoss) takes its cross-entropy through torch.compile."""
    from forge.train.losses import CrossEntropyLoss

    loss = instantiate(cfg.loss) if cfg.get("loss") is not None else CrossEntropyLoss()
    if cfg.parallel.get("compile") and hasattr(loss, "compile"):
        loss.compile()
        log.info("torch.compile of the loss's cross-entropy")
    return loss


def build_corpus(cfg: DictConfig) -> Corpus:
    return instantiate(cfg.data)


def build_loader(train: "TrainConfig", corpus: Corpus, dp_rank: int, dp_size: int) -> Loader:
    """This rank's training loader of the corpus."""
    return corpus.make_loader(
        train.seq_len, train.micro_batch_size, train.global_batch_size, train.seed, dp_rank, dp_size
    )


def config_yaml(cfg: DictConfig) -> str:
    return OmegaConf.to_yaml(cfg, resolve=True)


def materialize_parallel(cfg: DictConfig, model: nn.Module, device: torch.device, seed: int) -> None:
    """`materialize` for a model the parallel plan has sharded or wrapped (compiled or checkpointed blocks, whose
    parameter names gain a prefix): the same initial weights as one process."""
    from forge.parallel.init import has_dtensor_parameters, materialize_sharded, plain_name

    wrapped = any(plain_name(name) != name for name, _ in model.named_parameters())
    if not has_dtensor_parameters(model) and not wrapped:
        materialize(model, device, seed)
        return
    materialize_sharded(model, build_meta_model(cfg), seed, device)
