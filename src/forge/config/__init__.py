"""Config schemas, the composed-config validation pass and composition helpers."""

from forge.config.errors import ConfigError
from forge.config.paths import conf_dir
from forge.config.schema import register_schemas
from forge.config.validate import validate

__all__ = ["ConfigError", "compose", "conf_dir", "register_schemas", "validate"]


def compose(overrides: list[str] | None = None, config_name: str = "train"):
    """Compose the config as forge-train would (for tests, notebooks and tools)."""
    from hydra import compose as hydra_compose
    from hydra import initialize_config_dir

    register_schemas()
    with initialize_config_dir(config_dir=str(conf_dir()), version_base="1.3"):
        return hydra_compose(config_name=config_name, overrides=overrides or [])
