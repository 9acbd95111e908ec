"""What a resume may change: every key of the new config is compared with the checkpoint's config.yaml before
anything is built or loaded, and each changed key is named.

- Refused (unless checkpoint.check_resume_config=false): what changes the model, the data or what the saved
  state means. The loader's position counts samples of one global order cut into global batches of seq_len tokens,
  drawn with the run's seed from this data; the optimizer and scheduler states only mean something to the same
  kinds and the same parameter groups; DCP would load another model's weights whenever the shapes agree
  (model.rope_theta).
- Applied: optimizer hyperparameters (lr, betas, weight decay, ...) override the ones the optimizer state brings
  back, and the schedule (scheduler.*, train.steps) is the new one from the resumed step on.
- Free: everything else (parallel layout, micro-batch, precision, logging, evaluation, checkpointing, resilience).
"""

import dataclasses
from dataclasses import dataclass
from pathlib import Path

from omegaconf import MISSING, DictConfig, OmegaConf

from forge.checkpoint.errors import CheckpointError

REFUSED = (
    "model.",
    "vlm.",
    "data.",
    "train.global_batch_size",
    "train.seq_len",
    "train.seed",
    "optimizer._target_",
    "optimizer.adamw_params",
    "scheduler._target_",
)
"""Keys (or key prefixes ending in a dot) a resume must keep."""

FREE_DATA = ("data.cache_dir", "data.verify_checksums")
"""Keys under data. that do not change which samples are read."""

APPLIED = ("optimizer.", "scheduler.", "train.steps")
"""Keys a resume applies to the restored optimizer and schedule."""


@dataclass(frozen=True)
class Change:
    key: str
    old: object
    new: object
    kind: str  # refused | applied | free

    def __str__(self) -> str:
        return f"{self.key}={_show(self.new)} (was {_show(self.old)})"


def _show(value: object) -> str:
    return "absent" if value is _ABSENT else str(value)


_ABSENT = object()


def _matches(key: str, table: tuple[str, ...]) -> bool:
    return any(key == entry or (entry.endswith(".") and key.startswith(entry)) for entry in table)


def kind_of(key: str, is_vlm: bool) -> str:
    if key in FREE_DATA or (key == "train.seq_len" and is_vlm):  # a VLM's loader counts records, not tokens
        return "free"
    if _matches(key, REFUSED):
        return "refused"
    return "applied" if _matches(key, APPLIED) else "free"


def _flat(node, prefix: str = "") -> dict[str, object]:
    """Dotted key -> value; lists are values (a changed list is one change)."""
    if isinstance(node, dict):
        out: dict[str, object] = {}
        for key, value in node.items():
            out.update(_flat(value, f"{prefix}{key}."))
        return out if out or not prefix else {prefix[:-1]: {}}
    return {prefix[:-1]: node}


def _fill_new_keys(saved: DictConfig, current: DictConfig) -> None:
    """Give `saved` the schema default of each field of `current`'s schema nodes that it lacks."""
    schema = OmegaConf.get_type(current)
    if dataclasses.is_dataclass(schema):
        for f in dataclasses.fields(schema):
            declared = f.default is not dataclasses.MISSING and f.default != MISSING
            interpolated = isinstance(f.default, str) and "${" in f.default
            if f.name not in saved and declared and not interpolated:
                saved[f.name] = f.default
    for key in current:
        child, old = current._get_node(key), saved.get(key) if key in saved else None
        if isinstance(child, DictConfig) and isinstance(old, DictConfig) and not child._is_none():
            _fill_new_keys(old, child)


def config_changes(saved: DictConfig, current: DictConfig) -> list[Change]:
    """Every key whose value differs between the checkpoint's config and this run's, classified. A key that a
    schema gained after the checkpoint was written counts as its default there (an older run resumes)."""
    saved = saved.copy()
    _fill_new_keys(saved, current)
    old = _flat(OmegaConf.to_container(saved, resolve=True))
    new = _flat(OmegaConf.to_container(current, resolve=True))
    is_vlm = current.get("vlm") is not None
    changes = []
    for key in sorted(set(old) | set(new)):
        before, after = old.get(key, _ABSENT), new.get(key, _ABSENT)
        if before != after:
            changes.append(Change(key, before, after, kind_of(key, is_vlm)))
    return changes


def check_resume_config(path: Path, current: DictConfig, enforce: bool = True) -> list[Change]:
    """The changes of this resume from the checkpoint at `path`; a CheckpointError naming every refused one when
    `enforce`. Checkpoints without a config.yaml (written by other tools) are not checked."""
    file = path / "config.yaml"
    if not file.is_file():
        return []
    try:
        saved = OmegaConf.load(file)
        if not isinstance(saved, DictConfig):
            raise ValueError("not a mapping")
    except Exception as err:  # noqa: BLE001 - any failure to parse is a corrupt checkpoint
        raise CheckpointError(f"cannot read {file}: {err}") from err
    changes = config_changes(saved, current)
    refused = [c for c in changes if c.kind == "refused"]
    if refused and enforce:
        raise CheckpointError(
            f"cannot resume from {path}: " + "; ".join(map(str, refused)) + ". A resume keeps the model, the data, "
            "the global batch, sequence length, seed and the optimizer and scheduler kinds of the run it continues. "
            f"To start a new run from these weights: checkpoint.resume=none checkpoint.load_weights={path} and a new "
            "hydra.run.dir; to resume anyway: checkpoint.check_resume_config=false"
        )
    return changes
