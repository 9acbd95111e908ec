"""The error raised for a config that cannot run."""


class ConfigError(ValueError):
    """An impossible or unsupported combination of config values; the message names the keys."""
