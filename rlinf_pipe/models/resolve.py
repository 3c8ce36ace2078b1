"""Turn a config's model name (`actor.model_path`, `rollout.model_path`) into a local HF model folder.

Accepted: `tiny` (the tiny test model, built on first use; given a run's data config, the tiny model warm-started
on that data, see `rlinf_pipe.models.warmstart`), `smollm2-135m` (SmolLM2-135M-Instruct converted from PyPI, built
on first use), or the path of an existing folder holding `config.json`.
"""

from __future__ import annotations

import os
from collections.abc import Callable
from pathlib import Path
from typing import Any


def _tiny(cache_dir: str | os.PathLike[str] | None, data: Any) -> Path:
    if data is None:
        from rlinf_pipe.models.tiny import ensure_tiny_model

        return ensure_tiny_model(cache_dir)
    from rlinf_pipe.models.warmstart import ensure_warm_tiny_model

    return ensure_warm_tiny_model(cache_dir, data)


def _smollm2(cache_dir: str | os.PathLike[str] | None, data: Any) -> Path:
    from rlinf_pipe.models.smollm2 import ensure_smollm2

    return ensure_smollm2(cache_dir)


# name -> builder(cache_dir, data config or None) returning the folder (imported when called: the builders need
# transformers, which a check before launch should not load)
BUILTIN_MODELS: dict[str, Callable[[str | os.PathLike[str] | None, Any], Path]] = {
    "tiny": _tiny,
    "smollm2-135m": _smollm2,
}


def check_model_name(name_or_path: str | os.PathLike[str]) -> None:
    """Raise `ValueError`, listing what is accepted, unless `name_or_path` is a built-in model name or a folder
    that contains `config.json`. Builds nothing and imports no model code (a run checks this before Ray starts)."""
    name = os.fspath(name_or_path)
    if name in BUILTIN_MODELS:
        return
    path = Path(name).expanduser()
    if path.is_dir():
        if not (path / "config.json").is_file():
            raise ValueError(f"model folder {name!r} has no config.json; an HF model folder must contain config.json")
        return
    names = ", ".join(repr(n) for n in BUILTIN_MODELS)
    raise ValueError(
        f"unknown model {name!r}: not a built-in model name ({names}) and not an existing folder. "
        "Give one of those names or the path of an HF model folder that contains config.json."
    )


def resolve_model_path(
    name_or_path: str | os.PathLike[str], cache_dir: str | os.PathLike[str] | None = None, data: Any = None
) -> Path:
    """The local folder of `name_or_path`: a built-in model name (built under `cache_dir` on first use) or a
    folder that contains `config.json`. `data` (a run's `DataConfig`) makes `tiny` the tiny model warm-started
    on that data. Raises `ValueError` for anything else, listing what is accepted (`check_model_name`).
    """
    check_model_name(name_or_path)
    name = os.fspath(name_or_path)
    builder = BUILTIN_MODELS.get(name)
    if builder is not None:
        return builder(cache_dir, data)
    return Path(name).expanduser()
