"""Builders for the pieces of a run, each from its config group."""

import inspect
import logging

import torch
from hydra.utils import instantiate
from omegaconf import DictConfig, OmegaConf
from torch import nn

from forge.data.loader import BatchLoader, TokenWindows
from forge.data.sources import DataError
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
    model.init_weights(seed=seed)


def build_optimizer(cfg: DictConfig, model: nn.Module):
    """The optimizer and its schedule. A target whose first parameter is named `model` (Muon, which tells the
    head from hidden matrices by name) gets the model; any other gets param_groups(model)."""
    make = instantiate(cfg.optimizer, _convert_="all")  # plain lists: the state is saved and read weights_only
    takes_model = next(iter(inspect.signature(make.func).parameters)) == "model"
    optimizer = make(model if takes_model else param_groups(model))
    scheduler = instantiate(cfg.scheduler)(optimizer)
    return optimizer, scheduler


def build_loss(cfg: DictConfig):
    """The training loss (conf/loss); plain cross-entropy when the config has no loss group."""
    from forge.train.losses import CrossEntropyLoss

    return instantiate(cfg.loss) if cfg.get("loss") is not None else CrossEntropyLoss()


def build_corpus(cfg: DictConfig):
    return instantiate(cfg.data)


def split_windows(tokens, cfg: DictConfig, split: str) -> TokenWindows:
    """The samples of one split, or a DataError naming the split, its size and what to change."""
    where = f" of data.path={cfg.data.path}" if "path" in cfg.data else ""
    vocab = cfg.data.get("vocab_size")
    try:
        return TokenWindows(tokens, cfg.train.seq_len, vocab, f"the {split} split{where}")
    except ValueError as err:
        fraction = f" (data.val_fraction={cfg.data.val_fraction})" if "val_fraction" in cfg.data else ""
        raise DataError(
            f"the {split} split{where}{fraction} is too short for train.seq_len={cfg.train.seq_len}: {err}; "
            "use a shorter train.seq_len"
            + (", a larger data.val_fraction" if fraction and split == "validation" else "")
            + " or more data"
        ) from err


def build_loader(cfg: DictConfig, corpus, dp_rank: int, dp_size: int):
    """The training loader of a corpus (or of a bare token array): the corpus's own (mixtures) or a BatchLoader."""
    train = cfg.train
    if hasattr(corpus, "make_loader"):
        return corpus.make_loader(
            train.seq_len, train.micro_batch_size, train.global_batch_size, train.seed, dp_rank, dp_size
        )
    tokens = getattr(corpus, "train_tokens", corpus)
    windows = split_windows(tokens, cfg, "training")
    return BatchLoader(
        windows,
        train.micro_batch_size,
        train.seed,
        dp_rank,
        dp_size,
        document_eos(cfg, corpus),
        global_batch=train.global_batch_size,
    )


def document_eos(cfg: DictConfig, corpus) -> int | None:
    """The EOS id when data.document_masking is on (batches then carry document ids), else None."""
    return corpus.eos_id if cfg.data.get("document_masking", False) else None


def config_yaml(cfg: DictConfig) -> str:
    return OmegaConf.to_yaml(cfg, resolve=True)


def materialize_parallel(cfg: DictConfig, model: nn.Module, device: torch.device, seed: int) -> None:
    """`materialize` for a model the parallel plan has sharded: the same initial weights as one process."""
    from forge.parallel.init import has_dtensor_parameters, materialize_sharded

    if not has_dtensor_parameters(model):
        materialize(model, device, seed)
        return
    materialize_sharded(model, build_meta_model(cfg), seed, device)
