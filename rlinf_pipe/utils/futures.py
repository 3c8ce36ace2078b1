"""Helpers for asyncio futures."""

from __future__ import annotations

import asyncio


def mark_retrieved(future: asyncio.Future) -> None:
    """A done callback that marks the future's failure as seen, for futures that may end with nobody awaiting them
    (a pushed weight transfer whose step was abandoned, a wait shielded from a cancelled caller): asyncio would
    otherwise log "exception was never retrieved"."""
    if not future.cancelled():
        future.exception()
