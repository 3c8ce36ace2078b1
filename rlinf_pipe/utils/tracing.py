"""Spans: what each worker was doing and when, collected into the run's timeline.

Every worker owns a `Tracer` whose track names the worker (`actor/0`); `with tracer.span("train", step=3):`
records wall-clock start and end (`now()`: time.time(), comparable across the processes of a host). The runner
drains each worker's spans after every step, shifts those of other hosts by their clock's measured offset
(rlinf_pipe.runner.clocks), and writes them to `timeline.json` (see rlinf_pipe.utils.timeline).
"""

from __future__ import annotations

import os
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import msgspec


STEP_SPAN = "step"  # the driver's span around a whole step; its args carry `step`
LAUNCH_SPAN = "launch"
"""A job's launch, before its first step: each worker's span from its process's start until it is built (on its
GPUs; args: `build_s`, the time in its constructor), and the driver's span over the whole launch (args: `phase:
"job"`) and over each of its phases (`phase`: preflight, ray_start, import, prepare, start_workers; import and
prepare run in a helper thread, on track `driver/prepare`). Launch spans are not part of any step's figures."""


def now() -> float:
    """The clock of spans: seconds since the epoch on this host's clock."""
    return time.time()


def process_started() -> float:
    """When this process started, on the clock of spans (Linux: its age from /proc, to the scheduler's tick;
    psutil's start time counts from the boot time in whole seconds)."""
    try:
        with open("/proc/self/stat") as stat, open("/proc/uptime") as uptime:
            ticks = int(stat.read().rsplit(")", 1)[1].split()[19])  # field 22, starttime (after "pid (comm)")
            age = float(uptime.read().split()[0]) - ticks / os.sysconf("SC_CLK_TCK")
        return now() - max(age, 0.0)
    except (OSError, ValueError, IndexError):
        import psutil

        return psutil.Process().create_time()


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
        start = now()
        extra: dict[str, Any] = dict(args)
        try:
            yield extra
        finally:
            self.add(name, start, now(), **extra)

    def drain(self) -> list[Span]:
        with self._lock:
            spans, self._spans = self._spans, []
        return spans
