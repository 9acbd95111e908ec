"""`forge-prepare-data`: compose conf/prepare.yaml with key=value overrides, then tokenise into shards."""

import logging
import sys

import hydra
from omegaconf import DictConfig
from omegaconf.errors import MissingMandatoryValue

from forge.config import ConfigError, conf_dir, register_schemas
from forge.config.domains import validate_domains
from forge.data.sources import DataError

log = logging.getLogger("forge")

EXIT_DATA_ERROR = 2


def validate_prepare(cfg: DictConfig) -> None:
    """Each field of conf/prepare.yaml inside its declared domain (forge.domain); raises ConfigError naming it."""
    validate_domains(cfg)


def _task(cfg: DictConfig) -> None:
    from forge.data.prepare import prepare

    try:
        validate_prepare(cfg)
    except ConfigError as err:
        print(f"forge-prepare-data: invalid config: {err}", file=sys.stderr)
        sys.exit(EXIT_DATA_ERROR)
    try:
        meta, reused = prepare(cfg)
    except (DataError, FileNotFoundError, MissingMandatoryValue) as err:
        print(f"forge-prepare-data: error: {err}", file=sys.stderr)
        sys.exit(EXIT_DATA_ERROR)
    rate = meta["tokens"] / max(meta["seconds"], 1e-9)
    print(
        f"forge-prepare-data: {'reused' if reused else 'wrote'} {cfg.out_dir}: {meta['tokens']:,} tokens, "
        f"{meta['documents']:,} documents, {len(meta['shards'])} shard(s) of {meta['dtype']}, vocab "
        f"{meta['vocab_size']}" + ("" if reused else f", {rate:,.0f} tokens/s")
    )


def main() -> None:
    register_schemas()
    hydra.main(config_path=str(conf_dir()), config_name="prepare", version_base="1.3")(_task)()


if __name__ == "__main__":
    sys.exit(main())
