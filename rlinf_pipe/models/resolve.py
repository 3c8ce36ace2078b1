"""Turn a config's model name (`actor.model_path`, `rollout.model_path`) into a local HF model folder.

Accepted: `tiny` (the tiny test model, built on first use), `smollm2-135m` (SmolLM2-135M-Instruct converted
from PyPI, built on first use), or the path of an existing folder holding `config.json`.
"""

from __future__ import annotations

import os
from collections.abc import Callable
from pathlib import Path

from rlinf_pipe.models.smollm2 import ensure_smollm2
from rlinf_pipe.models.tiny import ensure_tiny_model

# name -> builder(cache_dir) returning the folder
BUILTIN_MODELS: dict[str, Callable[[str | os.PathLike[str] | None], Path]] = {
    "tiny": lambda cache_dir: ensure_tiny_model(cache_dir),
    "smollm2-135m": lambda cache_dir: ensure_smollm2(cache_dir),
}


def resolve_model_path(name_or_path: str | os.PathLike[str], cache_dir: str | os.PathLike[str] | None = None) -> Path:
    """The local folder of `name_or_path`: a built-in model name (built under `cache_dir` on first use) or a
    folder that contains `config.json`. Raises `ValueError` for anything else, listing what is accepted.
    """
    name = os.fspath(name_or_path)
    builder = BUILTIN_MODELS.get(name)
    if builder is not None:
        return builder(cache_dir)
    path = Path(name).expanduser()
    if path.is_dir():
        if not (path / "config.json").is_file():
            raise ValueError(f"model folder {name!r} has no config.json; an HF model folder must contain config.json")
        return path
    names = ", ".join(repr(n) for n in BUILTIN_MODELS)
    raise ValueError(
        f"unknown model {name!r}: not a built-in model name ({names}) and not an existing folder. "
        "Give one of those names or the path of an HF model folder that contains config.json."
    )
