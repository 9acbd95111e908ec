"""What a resume must keep: checked against the config saved in the checkpoint before anything is loaded.

The loader's position counts samples of one global order cut into global batches of seq_len tokens, drawn with
the run's seed; the optimizer and scheduler states only mean something to the same kinds. Another value of any of
these would resume without an error from DCP and silently train on other data or another schedule.
"""

from pathlib import Path

from omegaconf import DictConfig, OmegaConf

from forge.checkpoint.errors import CheckpointError

FIXED_ON_RESUME = (
    "train.global_batch_size",
    "train.seq_len",
    "train.seed",
    "optimizer._target_",
    "scheduler._target_",
)


def check_resume_config(path: Path, current: DictConfig) -> None:
    """Raise CheckpointError naming every key of FIXED_ON_RESUME whose value differs from the checkpoint's.

    Checkpoints without a config.yaml (written by other tools) are not checked, nor is train.seq_len of a VLM (its
    loader counts records, which a cut of the text at another length does not change).
    """
    file = path / "config.yaml"
    if not file.is_file():
        return
    try:
        saved = OmegaConf.load(file)
    except Exception as err:  # noqa: BLE001 - any failure to parse is a corrupt checkpoint
        raise CheckpointError(f"cannot read {file}: {err}") from err
    changed = []
    fixed = [k for k in FIXED_ON_RESUME if not (k == "train.seq_len" and current.get("vlm") is not None)]
    for key in fixed:
        old, new = OmegaConf.select(saved, key), OmegaConf.select(current, key)
        if old is not None and old != new:
            changed.append(f"{key}={new} (the checkpoint has {old})")
    if changed:
        raise CheckpointError(
            f"cannot resume from {path}: " + "; ".join(changed) + ". A resume must keep the global batch, sequence "
            "length, seed, optimizer and scheduler of the run it continues. To start a new run from these weights: "
            f"checkpoint.resume=none checkpoint.load_weights={path} and a new hydra.run.dir; to resume anyway: "
            "checkpoint.check_resume_config=false"
        )
