"""Stopping a run on SIGINT / SIGTERM (Ctrl-C, `kill`, Slurm, Kubernetes).

The first signal asks the run to stop: the step in progress may finish within `runner.stop_grace_s`, else it is
abandoned; the runner then saves if asked (`runner.save_on_signal`), shuts the job down and raises `RunStopped`
(exit 130 / 143). Before training starts (while the job launches), and for a second signal at any time, the stop is
immediate: `RunStopped` is raised where the program is, and the usual clean-up runs on the way out.
"""

from __future__ import annotations

import asyncio
import signal
import threading
from collections.abc import Awaitable
from types import FrameType
from typing import Any, TypeVar

from rlinf_pipe.errors import RunStopped

T = TypeVar("T")
SIGNALS = (signal.SIGINT, signal.SIGTERM)


class StepAbandoned(Exception):
    """The step in progress did not finish within the grace period after a stop signal."""


class StopSignals:
    """Installs the handlers (main thread only; elsewhere it does nothing) and tells the run loop whether a stop
    was asked. Use as a context manager around the run: the previous handlers come back on exit."""

    def __init__(self, grace_s: float):
        self.grace_s = grace_s
        self.signum: int | None = None
        self.loop: asyncio.AbstractEventLoop | None = None
        self.event: asyncio.Event | None = None
        self.previous: dict[int, Any] = {}

    def __enter__(self) -> StopSignals:
        if threading.current_thread() is threading.main_thread():
            self.previous = {sig: signal.signal(sig, self._handle) for sig in SIGNALS}
        return self

    def reinstall(self) -> None:
        """Take the signals back (connecting to Ray installs Ray's own handlers, which abort the process)."""
        if self.previous and threading.current_thread() is threading.main_thread():
            for sig in SIGNALS:
                signal.signal(sig, self._handle)

    def __exit__(self, *exc: object) -> None:
        for sig, handler in self.previous.items():
            signal.signal(sig, handler)
        self.previous = {}

    @property
    def requested(self) -> bool:
        return self.signum is not None

    @property
    def name(self) -> str:
        return signal.Signals(self.signum).name if self.signum is not None else ""

    def attach(self, loop: asyncio.AbstractEventLoop) -> None:
        """From here on a first signal asks the loop's run to stop instead of stopping at once."""
        self.reinstall()
        self.loop, self.event = loop, asyncio.Event()
        if self.signum is not None:
            self.event.set()

    def detach(self) -> None:
        self.loop, self.event = None, None

    def _handle(self, signum: int, frame: FrameType | None) -> None:
        first = self.signum is None
        self.signum = signum
        if first and self.loop is not None and self.event is not None:
            self.loop.call_soon_threadsafe(self.event.set)
            return
        name = signal.Signals(signum).name
        raise RunStopped(signum, f"stopped at once by {name}" + ("" if first else " (a second signal)"))

    async def or_abandon(self, call: Awaitable[T]) -> T:
        """`call`'s result; once a stop is asked it has `grace_s` to finish, then it is cancelled and
        `StepAbandoned` raised."""
        task = asyncio.ensure_future(call)
        if self.event is None:
            return await task
        stop = asyncio.ensure_future(self.event.wait())
        try:
            await asyncio.wait({task, stop}, return_when=asyncio.FIRST_COMPLETED)
            if not task.done():
                await asyncio.wait({task}, timeout=self.grace_s)
            if not task.done():
                task.cancel()
                raise StepAbandoned(f"the step did not finish within runner.stop_grace_s={self.grace_s:g} s")
            return task.result()
        finally:
            stop.cancel()
            if not task.done():
                task.cancel()
