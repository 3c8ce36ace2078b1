"""`VersionWait`: a call that needs weight version v waits for the call of the same worker that makes it.

An engine's generation waits for the weight sync loading v; the actor's send of v waits for the training step that
trains it. The wait fails, naming why, when that call failed, or when the step was abandoned meanwhile (`cancel`,
from another thread): it never outlives the call it waits for.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import Callable, Iterator

from rlinf_pipe.weights import WeightSyncError


class VersionWait:
    """Where `owner`'s model gets its versions: `making(v)` wraps the call that makes version v, `wait_for(v)` waits
    for it; `verb` says what making a version is ("load", "train") in the errors."""

    def __init__(self, owner: str, verb: str):
        self.owner, self.verb = owner, verb
        self.failed: tuple[int, str] | None = None  # the version whose last making failed, and why
        self.epoch = 0  # counts abandoned steps: a wait of an abandoned step ends
        self._loop: asyncio.AbstractEventLoop | None = None  # the event loop that waits and makes
        self._changed: asyncio.Future | None = None  # resolved when a making ends or a step is abandoned

    @contextlib.contextmanager
    def making(self, version: int) -> Iterator[None]:
        """Around the call that makes `version`: a failure is recorded for the waits (and raised), and every wait
        looks again once the call ended."""
        self._loop, self.failed = asyncio.get_running_loop(), None
        try:
            yield
        except BaseException as exc:
            self.failed = (version, f"{type(exc).__name__}: {exc}")
            raise
        finally:
            self._notify()

    async def wait_for(self, version: int, current: Callable[[], int]) -> None:
        """Return once the model holds `version` (`current()`). Raises `WeightSyncError` when the call making it
        failed, or when the step is abandoned meanwhile."""
        self._loop, epoch = asyncio.get_running_loop(), self.epoch
        while current() != version:
            if self.failed is not None and self.failed[0] == version:
                raise WeightSyncError(f"{self.owner}: weight version {version} did not {self.verb}: {self.failed[1]}")
            if self.epoch != epoch:
                raise WeightSyncError(f"{self.owner}: the step was abandoned while waiting for weight version "
                                      f"{version}")
            if self._changed is None or self._changed.done():
                self._changed = self._loop.create_future()
            await self._changed

    def _notify(self) -> None:
        if self._changed is not None and not self._changed.done():
            self._changed.set_result(None)

    def cancel(self) -> None:
        """From another thread: end every wait (the step is abandoned); an earlier failure no longer fails the
        retried step's waits."""
        self.epoch += 1
        self.failed = None
        if self._loop is not None:
            self._loop.call_soon_threadsafe(self._notify)
