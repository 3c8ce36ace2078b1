"""The sglang 0.5.23 API as `scripts/sglang_contract.py` extracted it from the real wheel (checked in)."""

from __future__ import annotations

import ast
import json
from pathlib import Path
from typing import Any

CONTRACT: dict[str, Any] = json.loads((Path(__file__).parents[1] / "sglang_contract.json").read_text())


def default(source: str | None) -> Any:
    """A field's or parameter's default from its source text (`None`: no default)."""
    return ast.literal_eval(source) if source is not None else None


def message(key: str) -> str:
    """One of the error messages the real scheduler returns."""
    return CONTRACT["messages"][key]
