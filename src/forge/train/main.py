"""`forge-train`: compose the config with Hydra, validate it, train."""

import logging
import sys
from pathlib import Path

import hydra
from hydra.core.hydra_config import HydraConfig
from omegaconf import DictConfig, OmegaConf

from forge.config import ConfigError, conf_dir, register_schemas
from forge.config.help import field_help

log = logging.getLogger("forge")

EXIT_CONFIG_ERROR = 2


def run(cfg: DictConfig) -> dict:
    from forge.train.trainer import Trainer

    run_dir = Path(HydraConfig.get().runtime.output_dir)
    return Trainer(cfg, run_dir).fit()


def _task(cfg: DictConfig) -> None:
    try:
        run(cfg)
    except ConfigError as err:
        print(f"forge-train: invalid config: {err}", file=sys.stderr)
        sys.exit(EXIT_CONFIG_ERROR)


def main() -> None:
    register_schemas()
    if not OmegaConf.has_resolver("forge_field_help"):
        OmegaConf.register_new_resolver("forge_field_help", field_help)
    hydra.main(config_path=str(conf_dir()), config_name="train", version_base="1.3")(_task)()


if __name__ == "__main__":
    main()
