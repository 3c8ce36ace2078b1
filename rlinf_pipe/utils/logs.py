"""Keeping this process's logging as it was around code that reconfigures it (a library built in-process)."""

from __future__ import annotations

import contextlib
import logging
from collections.abc import Iterator


@contextlib.contextmanager
def logging_kept() -> Iterator[None]:
    """Put the root logger's level and handlers back after the block, and which loggers were enabled: sglang's
    Engine, built in this process, calls `logging.basicConfig(level=<its log_level>, force=True)` (or `dictConfig`
    with SGLANG_LOGGING_CONFIG_PATH, which disables every logger it does not name), which would close our handlers
    and hide every message below ERROR from our own modules for the life of the worker. Our handlers are set aside
    during the block, so a forced `basicConfig` does not close them (a `dictConfig` closes every handler there is:
    stream handlers write on, a file opened in mode "w" does not); what the block attached to the root is removed
    after."""
    root = logging.getLogger()
    level, handlers = root.level, list(root.handlers)
    disabled = {name: logger.disabled for name, logger in logging.Logger.manager.loggerDict.items()
                if isinstance(logger, logging.Logger)}
    for handler in handlers:
        root.removeHandler(handler)
    try:
        yield
    finally:
        for handler in list(root.handlers):
            root.removeHandler(handler)
            handler.close()
        for handler in handlers:
            root.addHandler(handler)
        root.setLevel(level)
        for name, was in disabled.items():
            logging.getLogger(name).disabled = was
