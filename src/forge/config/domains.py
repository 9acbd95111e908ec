"""Every composed value inside its field's declared domain (forge.domain): the first check on a value, before the
rules between fields (forge.config.validate) and before anything is built."""

import dataclasses
import re
from collections.abc import Iterator

from omegaconf import DictConfig, ListConfig, OmegaConf

from forge.config.errors import ConfigError
from forge.domain import domain_of


def shown(value) -> str:
    """A value as the refusal shows it: strings quoted (an empty one visibly), numbers and lists as written."""
    return repr(value) if isinstance(value, str) else str(value)


def validate_domains(cfg: DictConfig) -> None:
    """Refuse the first field whose value is outside its domain, naming the key, the value and the domain. Values
    set directly are checked before those interpolated from another key (`scheduler.total_steps: ${train.steps}`),
    so the refusal names the key the user set."""
    fields = list(schema_fields(cfg, ""))
    for source in ("set", "resolver", "reference"):
        for node, field, key in fields:
            if value_source(node, field.name) != source:
                continue
            interpolated = source != "set"
            value = node[field.name]
            if isinstance(value, DictConfig | ListConfig):
                value = OmegaConf.to_container(value, resolve=True)
            why = domain_of(field).reason(value)
            if why:
                source = f" (from {node._get_node(field.name)._value()})" if interpolated else ""
                raise ConfigError(f"{key}={shown(value)}{source} {why}")


def value_source(node: DictConfig, name: str) -> str:
    """How a field got its value: set directly, from a resolver (`${oc.env:STEPS}`: the user's own key), or as a
    reference to another key (`${train.steps}`: that key is named when it is refused)."""
    if not OmegaConf.is_interpolation(node, name):
        return "set"
    raw = str(node._get_node(name)._value())
    return "reference" if re.fullmatch(r"\$\{[\w.\[\]]+\}", raw) else "resolver"


def schema_fields(node: DictConfig, prefix: str) -> Iterator[tuple[DictConfig, dataclasses.Field, str]]:
    """(node, field, full key) of every set field with a declared domain, in `node` and every schema-typed node
    within it (model.moe, data.sources.<name>, data.phases[i]); a ??? (unset) value is validate_required's."""
    schema = OmegaConf.get_type(node)
    if dataclasses.is_dataclass(schema):
        for field in dataclasses.fields(schema):
            if domain_of(field) is not None and field.name in node and not OmegaConf.is_missing(node, field.name):
                yield node, field, f"{prefix}{field.name}"
    for key in node:
        child = node._get_node(key)
        if child._is_interpolation():
            continue  # a whole node taken from another key: its own fields are checked where it is declared
        if isinstance(child, DictConfig) and not child._is_none() and not child._is_missing():
            yield from schema_fields(child, f"{prefix}{key}.")
        elif isinstance(child, ListConfig) and not child._is_none() and not child._is_missing():
            for i, item in enumerate(child):
                if isinstance(item, DictConfig):
                    yield from schema_fields(item, f"{prefix}{key}[{i}].")
