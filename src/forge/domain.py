"""The values a config field takes, declared beside its type and docstring.

    grad_clip: float = domain(1.0, ge=0)
    \"\"\"Clip the global gradient norm to this (0 disables clipping).\"\"\"

`domain` is a dataclass field whose metadata holds a `Domain`: the schemas (forge.config.schema,
forge.models.llama.args, ...) declare every field's range this way, forge.config.domains refuses a composed value
outside it (one line naming the key, the value and the domain) before anything else reads the config, and
`forge-train --help` prints it. Rules between fields stay in forge.config.validate. A leaf module: the model's
argument dataclasses use it too.
"""

import copy
import dataclasses
import math
import operator
from dataclasses import dataclass
from typing import Any

INT64_MAX = 2**63 - 1
"""The largest integer torch and numpy hold in a tensor size, a seed or a step: every int field stays within it."""


@dataclass(frozen=True)
class Domain:
    """A range and shape rules for one field's value; None (null) is the field's type's business (Optional)."""

    ge: float | None = None
    gt: float | None = None
    le: float | None = None
    lt: float | None = None
    non_empty: bool = False
    """A string with more than whitespace, a list or a mapping with an entry."""
    length: int | None = None
    """A list of exactly this many entries."""
    each: "Domain | None" = None
    """The domain of every entry of a list (every value of a mapping)."""
    allowed: tuple[str, ...] | None = None
    """The strings the value (or, with `each`, an entry) may be."""
    means: str = ""
    """What an edge value means, for --help and the refusal (e.g. "0 disables clipping")."""

    def reason(self, value: Any) -> str | None:
        """Why `value` is outside this domain, or None when it is inside."""
        if value is None:
            return None
        if isinstance(value, bool):
            return None  # bool fields have two values; OmegaConf refuses anything else
        if isinstance(value, int | float):
            return self._number_reason(value)
        if isinstance(value, str):
            if self.non_empty and not value.strip():
                return "must not be empty"
            if self.allowed is not None and value not in self.allowed:
                return "is not one of " + ", ".join(self.allowed)
            return None
        if isinstance(value, list | tuple | dict):
            if self.non_empty and not value:
                return "must not be empty"
            if self.length is not None and len(value) != self.length:
                return f"must have {self.length} entries"
            entries = value.values() if isinstance(value, dict) else value
            for entry in entries:
                why = self.each.reason(entry) if self.each is not None else None
                if why:
                    return f"has {entry!r}, which {why}"
        return None

    def _number_reason(self, value: float) -> str | None:
        within = f" {self.describe()}" if self.describe() else ""
        if isinstance(value, float) and not math.isfinite(value):
            return f"must be a finite number{within}"
        if isinstance(value, int) and abs(value) > INT64_MAX:
            return "does not fit a 64-bit integer" + (f": must be{within}" if within else "")
        bounds = ((self.ge, operator.ge), (self.gt, operator.gt), (self.le, operator.le), (self.lt, operator.lt))
        if all(holds(value, bound) for bound, holds in bounds if bound is not None):
            return None
        return "must be " + self.describe()

    def describe(self) -> str:
        """The domain in words: `>= 0`, `in (0, 1]`, `one of a, b`, `non-empty`."""
        low = f"[{_num(self.ge)}" if self.ge is not None else f"({_num(self.gt)}" if self.gt is not None else None
        high = f"{_num(self.le)}]" if self.le is not None else f"{_num(self.lt)})" if self.lt is not None else None
        if low and high:
            words = f"in {low}, {high}"
        elif low:
            words = (">= " if low[0] == "[" else "> ") + low[1:]
        elif high:
            words = ("<= " if high[-1] == "]" else "< ") + high[:-1]
        elif self.allowed is not None:
            words = "one of " + ", ".join(self.allowed)
        else:
            words = ""
        parts = [words] if words else []
        if self.non_empty:
            parts.append("non-empty")
        if self.length is not None:
            parts.append(f"{self.length} entries")
        if self.each is not None:
            parts.append(f"each {self.each.describe()}")
        text = ", ".join(parts)
        return f"{text} ({self.means})" if self.means else text


def _num(bound: float) -> str:
    """A bound as the user would write it: 1, 0.5, 2**32 - 1 as its digits."""
    return str(int(bound)) if float(bound).is_integer() else repr(bound)


def domain(default: Any, **rules: Any) -> Any:
    """A dataclass field with this default and a Domain built from `rules` (Domain's fields). Lists and mappings
    get a fresh copy per instance."""
    metadata = {"domain": Domain(**rules)}
    if isinstance(default, list | dict):
        return dataclasses.field(default_factory=lambda: copy.deepcopy(default), metadata=metadata)
    return dataclasses.field(default=default, metadata=metadata)


def domain_of(field: dataclasses.Field) -> Domain | None:
    """The Domain a field declares, or None."""
    return field.metadata.get("domain")


def out_of_domain(instance: Any, prefix: str = "") -> str | None:
    """The first field of a dataclass instance (and of the dataclasses it holds) outside its declared domain, as
    `key=value why`; None when every value is inside. For arguments built from a file (an HF config.json) rather
    than a composed config."""
    for field in dataclasses.fields(instance):
        value = getattr(instance, field.name)
        if dataclasses.is_dataclass(value) and not isinstance(value, type):
            fault = out_of_domain(value, f"{prefix}{field.name}.")
            if fault:
                return fault
            continue
        domain = domain_of(field)
        why = domain.reason(value) if domain is not None else None
        if why:
            return f"{prefix}{field.name}={value!r} {why}"
    return None
