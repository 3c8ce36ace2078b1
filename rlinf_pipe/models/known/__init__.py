"""The `config.json` of models the example configs use, for the memory estimate of `rlinf-pipe plan` on a machine
that does not hold the model (only the architecture matters there; nothing else reads these files).

    known_config("/models/DeepSeek-R1-Distill-Qwen-1.5B")  # -> this package's copy, matched by the folder name
"""

from __future__ import annotations

import os
from pathlib import Path

KNOWN = Path(__file__).resolve().parent


def known_config(model_path: str | os.PathLike[str]) -> Path | None:
    """The shipped `config.json` of a model folder named like `model_path`'s last part (case-insensitive)."""
    name = Path(os.fspath(model_path)).name.lower()
    for folder in KNOWN.iterdir():
        if folder.is_dir() and folder.name.lower() == name and (folder / "config.json").is_file():
            return folder / "config.json"
    return None
