"""Folders the project writes, made complete or not at all: one marker file, `COMPLETE`, written last.

Every folder rlinf_pipe writes for later use (a checkpoint, the actor's part of it, a Megatron folder, a cached
model) holds `COMPLETE` (a JSON record of what was built) once it is whole; readers accept nothing else.
"""

from __future__ import annotations

import json
import os
import shutil
import tempfile
from collections.abc import Callable
from pathlib import Path
from typing import Any

COMPLETE = "COMPLETE"


def absolute(path: str | os.PathLike[str]) -> Path:
    """`path` absolute, for workers that start in other folders, with its symlinks kept (not `Path.resolve`): a
    link that each node points at its own mount (/outputs -> /mnt/nfs0/outputs) names the same folder everywhere,
    where its target may not."""
    return Path(os.path.abspath(path))


def is_complete(folder: str | os.PathLike[str]) -> bool:
    """Whether `folder` holds its completion marker."""
    return (Path(folder) / COMPLETE).is_file()


def mark_complete(folder: str | os.PathLike[str], record: dict[str, Any] | None = None) -> None:
    """Write the marker (atomically: a reader sees the whole record or no marker)."""
    folder = Path(folder)
    tmp = folder / f".{COMPLETE}.tmp"
    tmp.write_text(json.dumps(record or {}, sort_keys=True) + "\n")
    os.replace(tmp, folder / COMPLETE)


def build_folder_once(final: Path, build: Callable[[Path], dict[str, Any]]) -> Path:
    """`final` if it is complete; otherwise `build(tmp)` fills a temporary sibling, the marker (the record `build`
    returned) is written last, and the sibling is renamed into place. A half-written folder is never reused: one
    without the marker is deleted and rebuilt. Concurrent builders are safe (the first rename wins)."""
    if is_complete(final):
        return final
    final.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{final.name}.", dir=final.parent))
    try:
        mark_complete(tmp, build(tmp))
        if final.exists() and not is_complete(final):
            shutil.rmtree(final, ignore_errors=True)  # left over from an interrupted build
        try:
            os.rename(tmp, final)
        except OSError:
            if not is_complete(final):  # not another process finishing first: a real failure
                raise
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return final
