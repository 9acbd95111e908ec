"""Name the key of an interpolation that cannot be resolved, instead of OmegaConf's traceback at first use."""

from __future__ import annotations

from collections.abc import Iterator

from omegaconf import DictConfig, ListConfig, OmegaConf
from omegaconf.errors import InterpolationResolutionError, InterpolationToMissingValueError

from forge.config.errors import ConfigError


def _unresolvable(node: DictConfig | ListConfig, prefix: str) -> Iterator[tuple[str, str, str]]:
    """(key, raw value, reason) of every interpolation below `node` that fails to resolve. A reference to a `???`
    value is left to validate_required, which names all of them at once."""
    keys = range(len(node)) if isinstance(node, ListConfig) else list(node.keys())
    for key in keys:
        name = f"{prefix}{key}"
        child = node._get_node(key)
        nested = isinstance(child, DictConfig | ListConfig)
        if nested and not (child._is_none() or child._is_missing() or child._is_interpolation()):
            yield from _unresolvable(child, f"{name}.")
            continue
        if not OmegaConf.is_interpolation(node, key):
            continue
        try:
            node[key]
        except InterpolationToMissingValueError:
            continue
        except InterpolationResolutionError as err:
            yield name, str(child._value()), str(err.msg).splitlines()[0]


def validate_interpolations(cfg: DictConfig) -> None:
    """Refuse a value like `train.steps='${nope}'` or an unset `${oc.env:VAR}`, naming the key that holds it. When
    one failure causes others (scheduler.total_steps is `${train.steps}`), the key whose own value fails is named."""
    failing = list(_unresolvable(cfg, ""))
    if not failing:
        return
    keys = {key for key, _, _ in failing}
    own = [f for f in failing if not any(f"${{{other}}}" in f[1] for other in keys - {f[0]})]
    key, raw, reason = (own or failing)[0]
    raise ConfigError(f"{key}={raw!r} cannot be resolved: {reason}")
