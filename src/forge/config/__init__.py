"""Config schemas, the composed-config validation pass and composition helpers."""

from forge.config.errors import ConfigError, composition_message
from forge.config.paths import conf_dir
from forge.config.schema import register_schemas
from forge.config.validate import validate

__all__ = ["ConfigError", "compose", "conf_dir", "register_schemas", "validate"]


def compose(overrides: list[str] | None = None, config_name: str = "train"):
    """Compose the config as forge-train would (for tests, notebooks and tools); what Hydra cannot compose (a
    misspelled key, a wrong type, a choice its Enum does not have) raises ConfigError naming the key."""
    from hydra import compose as hydra_compose
    from hydra import initialize_config_dir
    from hydra.errors import HydraException

    register_schemas()
    with initialize_config_dir(config_dir=str(conf_dir()), version_base="1.3"):
        try:
            return hydra_compose(config_name=config_name, overrides=overrides or [])
        except HydraException as err:
            raise ConfigError(composition_message(err)) from err
