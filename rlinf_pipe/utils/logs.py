"""Keeping this process's logging as it was around code that reconfigures it (a library built in-process)."""

from __future__ import annotations

import contextlib
import logging
from collections.abc import Iterator


@contextlib.contextmanager
def logging_kept() -> Iterator[None]:
    """Put the root logger's level and handlers back after the block: sglang's Engine, built in this process, calls
    `logging.basicConfig(level=<its log_level>, force=True)`, which would drop our handlers and hide every message
    below ERROR from our own modules for the life of the worker."""
    root = logging.getLogger()
    level, handlers = root.level, list(root.handlers)
    try:
        yield
    finally:
        for handler in root.handlers:
            if handler not in handlers:
                root.removeHandler(handler)
                handler.close()
        for handler in handlers:
            if handler not in root.handlers:
                root.addHandler(handler)
        root.setLevel(level)
