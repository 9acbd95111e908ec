"""Packages whose re-exported names are imported on first use, so that importing one light submodule (a config
dataclass, a constant) does not import the package's torch code with it."""

import importlib
from collections.abc import Callable


def lazy_exports(package: str, exports: dict[str, str]) -> Callable[[str], object]:
    """A module `__getattr__` for `package`: `exports` maps each re-exported name to its submodule."""

    def __getattr__(name: str) -> object:
        if name not in exports:
            raise AttributeError(f"module {package!r} has no attribute {name!r}")
        return getattr(importlib.import_module(exports[name]), name)

    return __getattr__
