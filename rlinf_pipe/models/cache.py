"""Build a model folder once, atomically: the shared scheme of the tiny, warm-started and SmolLM2 folders."""

from __future__ import annotations

import json
import os
import shutil
import tempfile
from collections.abc import Callable
from pathlib import Path
from typing import Any


def build_folder_once(final: Path, marker: str, build: Callable[[Path], dict[str, Any]]) -> Path:
    """`final` if it holds `marker`; otherwise `build(tmp)` fills a temporary sibling, the marker (the JSON of what
    `build` returned) is written last, and the sibling is renamed into place. A half-written folder is never
    reused: one without the marker is deleted and rebuilt. Concurrent builders are safe (the first rename wins)."""
    if (final / marker).is_file():
        return final
    final.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{final.name}.", dir=final.parent))
    try:
        record = build(tmp)
        (tmp / marker).write_text(json.dumps(record, sort_keys=True) + "\n")
        if final.exists() and not (final / marker).is_file():
            shutil.rmtree(final, ignore_errors=True)  # left over from an interrupted build
        try:
            os.rename(tmp, final)
        except OSError:
            if not (final / marker).is_file():  # not another process finishing first: a real failure
                raise
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return final
