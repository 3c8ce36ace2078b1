"""Lazy re-exports for package `__init__` modules: a package names what it offers without importing the heavy
modules (torch, transformers) that define it until a name is used, so a process that needs one light submodule
(a Ray helper actor, the driver) does not pay for the rest."""

from __future__ import annotations

import importlib
from collections.abc import Callable
from typing import Any


def lazy_exports(package: str, exports: dict[str, str]) -> Callable[[str], Any]:
    """A module `__getattr__` for `package` that imports `exports[name]` (a submodule of it) on first use."""

    def __getattr__(name: str) -> Any:
        if name in exports:
            return getattr(importlib.import_module(f"{package}.{exports[name]}"), name)
        raise AttributeError(f"module {package!r} has no attribute {name!r}")

    return __getattr__
