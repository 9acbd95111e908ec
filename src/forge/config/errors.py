"""The error raised for a config that cannot run."""

import re


class ConfigError(ValueError):
    """An impossible or unsupported combination of config values; the message names the keys."""


def require(ok: bool, message: str) -> None:
    """A rule of the config: ConfigError(message) unless `ok` (the validation pass's and the model families')."""
    if not ok:
        raise ConfigError(message)


def composition_message(err: Exception) -> str:
    """One line for an error Hydra raises while composing (a bad override, a value of the wrong type, a choice
    that is not one of its Enum's, a missing config option): the key, the value and why."""
    cause = err.__cause__
    key = getattr(cause, "full_key", None)
    if not key:
        message = " ".join(str(err).split())  # a missing option lists the available ones on lines of their own
        override = getattr(err, "override", None)  # a grammar error names the override apart from its message
        return f"{override}: {message}" if override else message
    reason = str(getattr(cause, "msg", cause)).strip().splitlines()[0]
    value = getattr(cause, "value", None)
    if value is None:
        return f"{key}: {reason}"
    if "expected one of [" in reason:  # an Enum field: the same words as the validation pass's
        reason = "is not one of " + reason.split("expected one of [", 1)[1].rstrip("]")
        return f"{key}={value!r} {reason}"
    return f"{key}={value!r}: {reason}"


def null_section_message(err: Exception, overrides: list[str]) -> str | None:
    """One line for OmegaConf's failures to set values in a typed section the config leaves null (e.g.
    `model.rope_scaling={factor: 8.0}` or `model.rope_scaling.factor=8.0` on a preset without rope scaling), which
    Hydra does not wrap; None for any other error."""
    found = re.search(r"full_key: (\S+)", str(err))
    if isinstance(err, AttributeError) and found and "'NoneType' object" in str(err):
        keys = [found.group(1)]
    elif isinstance(err, AssertionError) and "Unexpected type for root: NoneType" in str(err):
        keys = [o.split("=", 1)[0].lstrip("+~") for o in overrides if "=" in o]
        keys = [key for key in keys if key.count(".") >= 2 and not key.startswith("hydra.")]
    else:
        return None
    return (
        f"{' or '.join(keys) or 'an override'}: a section this config leaves null cannot take values from the "
        "command line; set the section in a YAML file instead (a model preset, or an experiment in conf/experiment/)"
    )
