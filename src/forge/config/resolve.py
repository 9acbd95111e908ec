"""What a composed config leaves to the run, written into it before the rules read it: the micro batch a global
batch splits into, a prepared corpus's vocabulary, a preset's warmup cut to a short run. These are the only places
the config is written after composition; validation's rules then run on it read-only (forge.config.validate)."""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

from omegaconf import DictConfig, OmegaConf

from forge.config.errors import ConfigError, require
from forge.config.interpolations import validate_interpolations
from forge.config.schema import MemmapDataConfig


def composed_from(node: DictConfig, schema: type) -> bool:
    """Whether a config node is `schema` or a schema extending it: what it is, whatever its `_target_` says."""
    kind = OmegaConf.get_type(node)
    return isinstance(kind, type) and issubclass(kind, schema)


@contextlib.contextmanager
def read_only(cfg: DictConfig) -> Iterator[None]:
    """The config read-only for the block (OmegaConf raises on a write), its own flag restored after."""
    flag = cfg._get_node_flag("readonly")
    OmegaConf.set_readonly(cfg, True)
    try:
        yield
    finally:
        OmegaConf.set_readonly(cfg, flag)


def fill_micro_batch(train: DictConfig, dp: int, replicas: int = 1) -> None:
    """Set train.micro_batch_size when it is null: global_batch_size / (dp x replicas), or its largest divisor not
    above train.max_micro_batch_size (the rest is gradient accumulation). A given value is only checked.
    `replicas`: torchft's replica groups, which split the global batch too."""
    batch, micro, cap = train.global_batch_size, train.micro_batch_size, train.get("max_micro_batch_size")
    ranks = dp * replicas
    where = f"data-parallel ranks={dp}" + (f" x resilience.ft_replicas={replicas}" if replicas > 1 else "")
    if micro is not None:
        require(
            batch % (micro * ranks) == 0,
            f"train.global_batch_size={batch} is not divisible by train.micro_batch_size={micro} x {where} (leave "
            "train.micro_batch_size unset to split the global batch over the ranks)",
        )
        return
    require(
        batch % ranks == 0,
        f"train.global_batch_size={batch} cannot be split over {where}: make it a multiple of {ranks}",
    )
    per_rank = batch // ranks
    if cap is not None:
        per_rank = max(d for d in range(1, min(cap, per_rank) + 1) if (batch // ranks) % d == 0)
    train.micro_batch_size = per_rank


def override_keys(overrides: list[str]) -> frozenset[str]:
    """The config keys a list of Hydra overrides sets (`key=v`, `+key=v`, `++key=v`, `~key`)."""
    return frozenset(o.split("=", 1)[0].lstrip("+~") for o in overrides)


def fit_warmup_to_run(cfg: DictConfig, explicit_keys: frozenset[str]) -> str | None:
    """A warmup longer than the run (a preset's default, e.g. train.steps=4 against 20 steps of warmup) is cut to
    train.steps; returns the note saying so. Both set by the user (in `explicit_keys`) stays an error."""
    validate_interpolations(cfg)  # the first function forge-train runs on the config: before anything reads a value
    warmup = cfg.scheduler.get("warmup_steps")
    steps = cfg.train.steps
    if warmup is None or not isinstance(steps, int) or steps < 1 or warmup <= steps:
        return None
    if "scheduler.warmup_steps" in explicit_keys:
        return None  # validate_train names both keys
    cfg.scheduler.warmup_steps = steps
    return f"scheduler.warmup_steps={warmup} is longer than train.steps={steps}: warmup cut to {steps} steps"


def fill_vocab_from_data_meta(data: DictConfig) -> None:
    """data.vocab_size left unset for prepared shards (data.path): take it from the folder's meta.json, which
    forge-prepare-data wrote (the corpus checks the two agree anyway)."""
    import json
    from pathlib import Path

    if not composed_from(data, MemmapDataConfig) or "path" not in data or not OmegaConf.is_missing(data, "vocab_size"):
        return  # a key holding ??? is not `in` a DictConfig: path is set here
    meta = Path(str(data.path)).expanduser() / "meta.json"
    try:
        data.vocab_size = int(json.loads(meta.read_text())["vocab_size"])
    except (OSError, ValueError, KeyError, TypeError) as err:
        raise ConfigError(
            f"data.vocab_size is not set and cannot be read from data.path={data.path}: {meta} is missing or "
            f"unreadable ({type(err).__name__}); give data.path a folder written by forge-prepare-data"
        ) from err
