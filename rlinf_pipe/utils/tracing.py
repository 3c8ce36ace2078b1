"""Spans: what each worker was doing and when, collected into the run's timeline.

Every worker owns a `Tracer` whose track names the worker (`actor/0`); `with tracer.span("train", step=3):`
records wall-clock start and end (time.time(), comparable across processes on synchronised hosts). The runner
drains each worker's spans after every step and writes them to `timeline.json` (see rlinf_pipe.utils.timeline).
"""

from __future__ import annotations

import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import msgspec


class Span(msgspec.Struct, frozen=True):
    """One busy interval of one worker. `devices`: global GPU ids it occupied (empty: CPU only)."""

    name: str
    track: str
    start: float
    end: float
    devices: tuple[int, ...] = ()
    args: dict[str, Any] = {}

    @property
    def duration(self) -> float:
        return self.end - self.start


class Tracer:
    """Records `Span`s of one track; thread-safe; `drain()` hands them over and forgets them."""

    def __init__(self, track: str, devices: tuple[int, ...] = ()):
        self.track, self.devices = track, tuple(devices)
        self._spans: list[Span] = []
        self._lock = threading.Lock()

    def add(self, name: str, start: float, end: float, **args: Any) -> Span:
        span = Span(name, self.track, start, end, self.devices, args)
        with self._lock:
            self._spans.append(span)
        return span

    @contextmanager
    def span(self, name: str, **args: Any) -> Iterator[dict[str, Any]]:
        """Time the block; the yielded dict may be updated with more args before the block ends."""
        start = time.time()
        extra: dict[str, Any] = dict(args)
        try:
            yield extra
        finally:
            self.add(name, start, time.time(), **extra)

    def drain(self) -> list[Span]:
        with self._lock:
            spans, self._spans = self._spans, []
        return spans
