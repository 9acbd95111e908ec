"""The run directory's `.hydra/` record (composed config, Hydra's config, command-line overrides).

Hydra would write it before the task starts (conf/train.yaml sets `hydra.output_subdir: null` so it does not):
a resume refused for a changed config, or a second job refused by the run-directory lock, would then have
replaced the record of the run it refused. The trainer writes it once the run owns its directory.
"""

import os
from pathlib import Path

from hydra.core.hydra_config import HydraConfig
from omegaconf import DictConfig, OmegaConf

from forge.files import temp_file

RECORD_DIR = ".hydra"


def save_hydra_files(run_dir: Path, cfg: DictConfig) -> None:
    """Write `.hydra/config.yaml`, `hydra.yaml` and `overrides.yaml` as Hydra does; nothing without Hydra (a
    Trainer built in Python)."""
    if not HydraConfig.initialized():
        return
    hydra_cfg = HydraConfig.instance().cfg
    folder = Path(run_dir) / RECORD_DIR
    folder.mkdir(parents=True, exist_ok=True)
    for name, node in (
        ("config.yaml", cfg),
        ("hydra.yaml", hydra_cfg),
        ("overrides.yaml", OmegaConf.create(OmegaConf.to_container(hydra_cfg.hydra.overrides.task))),
    ):
        fd, tmp = temp_file(folder, prefix=f".{name}.")
        with os.fdopen(fd, "w", encoding="utf-8") as f:
            f.write(OmegaConf.to_yaml(node))
        os.replace(tmp, folder / name)
