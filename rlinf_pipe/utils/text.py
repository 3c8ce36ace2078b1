"""Wording helpers for user-facing errors."""

from __future__ import annotations

import difflib
from collections.abc import Iterable


def closest(name: str, valid: Iterable[str]) -> str:
    """A hint naming the closest valid names, or all of them when none is close."""
    valid = sorted(valid)
    near = difflib.get_close_matches(name, valid, n=3, cutoff=0.6)
    if near:
        return "did you mean " + " or ".join(f"`{v}`" for v in near) + "?"
    return "valid names: " + ", ".join(f"`{v}`" for v in valid)
