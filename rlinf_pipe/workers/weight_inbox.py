"""A worker's receiving end of weight sync: opened at start-up with the actor's layout, then one version a sync.

The driver asks for a step's generation while that step's weights are still syncing (one Ray round trip less before
the engines start): `wait_for(version)` holds the generation until the version is loaded, and fails it when that
sync failed or the step was abandoned."""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable
from contextlib import AbstractAsyncContextManager
from typing import Any

from rlinf_pipe.utils.tracing import Tracer
from rlinf_pipe.weights import (
    LoadBucket,
    LoadedWeights,
    WeightLayout,
    WeightReceiver,
    WeightSyncError,
    WeightVersion,
    check_version,
)
from rlinf_pipe.weights.layout import check_layout
from rlinf_pipe.weights.process_group import Rendezvous
from rlinf_pipe.weights.transports import Transport, open_receiver

Session = Callable[[int], AbstractAsyncContextManager[LoadBucket]]
NativeReceiver = Callable[[Transport, WeightLayout, Rendezvous | None, int], Awaitable[WeightReceiver | None]]


class WeightInbox:
    """Receives weight versions into a model; `session(version)` is the model's weight-update session (an async
    context yielding `load(bucket)`, setting the version on a clean exit)."""

    def __init__(self, owner: str, arch: Any, tracer: Tracer):
        self.owner, self.arch, self.tracer = owner, arch, tracer
        self.receiver: WeightReceiver | None = None  # opened by `open` once the actor's layout is known
        self.any_version = False  # the next version may be older than the loaded one (`rewind`)
        self.failed: tuple[int, str] | None = None  # the version whose last receive failed, and why
        self.epoch = 0  # counts abandoned steps: a wait of an abandoned step ends
        self._loop: asyncio.AbstractEventLoop | None = None  # the event loop that waits and receives
        self._changed: asyncio.Future | None = None  # resolved when a receive ends or a step is abandoned

    async def open(self, transport: Transport, layout: WeightLayout, rendezvous: Rendezvous | None, rank: int,
                   native: NativeReceiver | None = None) -> None:
        """Join the transport at `rank` (with everyone else in its group, at once), after checking `layout` against
        the model. `native` gives an engine's own receiver, when it has one for `transport`."""
        check_layout(layout, self.arch, self.owner)
        receiver = await native(transport, layout, rendezvous, rank) if native is not None else None
        if receiver is None:
            receiver = await asyncio.to_thread(open_receiver, transport, layout, self.arch, self.owner, rendezvous,
                                               rank)
        self.receiver = receiver

    async def receive(self, published: WeightVersion, current: int, session: Session, verify: bool) -> LoadedWeights:
        """Load `published` (newer than or equal to the `current` version) through `session`."""
        if self.receiver is None:
            raise RuntimeError(f"{self.owner}: weight sync before the weight transport was opened")
        if not self.any_version:
            check_version(current, published.version, self.owner)
        self._loop, self.failed = asyncio.get_running_loop(), None
        try:
            with self.tracer.span("weight_sync", version=published.version) as args:
                async with session(published.version) as load:
                    loaded = await self.receiver.receive(published, load, verify)
                args["bytes"] = loaded.num_bytes
        except BaseException as exc:
            self.failed = (published.version, f"{type(exc).__name__}: {exc}")
            raise
        finally:
            self._notify()
        self.any_version = False
        return loaded

    async def wait_for(self, version: int, current: Callable[[], int]) -> None:
        """Return once the model holds `version` (`current()`), which a sync may still be loading. Raises
        `WeightSyncError` when that sync failed, or when the step is abandoned meanwhile."""
        self._loop, epoch = asyncio.get_running_loop(), self.epoch
        while current() != version:
            if self.failed is not None and self.failed[0] == version:
                raise WeightSyncError(f"{self.owner}: weight version {version} did not load: {self.failed[1]}")
            if self.epoch != epoch:
                raise WeightSyncError(f"{self.owner}: the step was abandoned while waiting for weight version "
                                      f"{version}")
            if self._changed is None or self._changed.done():
                self._changed = self._loop.create_future()
            await self._changed

    def _notify(self) -> None:
        if self._changed is not None and not self._changed.done():
            self._changed.set_result(None)

    def rewind(self) -> None:
        """The actor went back to a checkpoint: the next version received may be older than the loaded one."""
        self.any_version = True

    def cancel(self) -> None:
        """From another thread: fail a transfer blocked on a lost peer (the transport is opened anew after) and a
        generation waiting for weights; an earlier failed receive no longer fails the retried step's waits."""
        self.epoch += 1
        self.failed = None
        if self._loop is not None:
            self._loop.call_soon_threadsafe(self._notify)
        if self.receiver is not None:
            self.receiver.cancel()
