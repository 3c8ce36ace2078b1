"""A worker's receiving end of weight sync: opened at start-up with the actor's layout, then one version a sync.

The driver asks for a step's generation while that step's weights are still syncing (one Ray round trip less before
the engines start): `wait_for(version)` holds the generation until the version is loaded, and fails it when that
sync failed or the step was abandoned."""

from __future__ import annotations

import asyncio
import time
from collections.abc import Awaitable, Callable
from contextlib import AbstractAsyncContextManager
from typing import Any

from rlinf_pipe.utils.tracing import Tracer
from rlinf_pipe.weights import (
    LoadBucket,
    LoadedWeights,
    WeightLayout,
    WeightReceiver,
    WeightVersion,
    check_version,
)
from rlinf_pipe.weights.layout import NamedTensors, check_layout
from rlinf_pipe.weights.process_group import Rendezvous
from rlinf_pipe.weights.transport_names import Transport
from rlinf_pipe.weights.transports import open_receiver
from rlinf_pipe.workers.version_wait import VersionWait

Session = Callable[[int], AbstractAsyncContextManager[LoadBucket]]
NativeReceiver = Callable[[Transport, WeightLayout, Rendezvous | None, int], Awaitable[WeightReceiver | None]]


class WeightInbox:
    """Receives weight versions into a model; `session(version)` is the model's weight-update session (an async
    context yielding `load(bucket)`, setting the version on a clean exit)."""

    def __init__(self, owner: str, arch: Any, tracer: Tracer):
        self.owner, self.arch, self.tracer = owner, arch, tracer
        self.receiver: WeightReceiver | None = None  # opened by `open` once the actor's layout is known
        self.any_version = False  # the next version may be older than the loaded one (`rewind`)
        self.loads = VersionWait(owner, "load")  # generations wait here for the version a sync is loading

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
        posted, loaded = time.time(), None
        arrived: list[float] = []  # when the first bucket arrived

        async def load_arrived(bucket: NamedTensors) -> None:
            if not arrived:
                arrived.append(time.time())
            await load(bucket)

        try:
            with self.loads.making(published.version):
                async with session(published.version) as load:
                    loaded = await self.receiver.receive(published, load_arrived, verify)
        finally:  # (the span starts when the bytes arrive: a receive asked for ahead first waits for the sender)
            start = arrived[0] if arrived else posted
            self.tracer.add("weight_sync", start, time.time(), version=published.version,
                            bytes=loaded.num_bytes if loaded else 0, waited_s=round(start - posted, 6))
        self.any_version = False
        return loaded

    async def wait_for(self, version: int, current: Callable[[], int]) -> None:
        """Return once the model holds `version` (`current()`), which a sync may still be loading. Raises
        `WeightSyncError` when that sync failed, or when the step is abandoned meanwhile."""
        await self.loads.wait_for(version, current)

    def rewind(self) -> None:
        """The actor went back to a checkpoint: the next version received may be older than the loaded one."""
        self.any_version = True

    def cancel(self) -> None:
        """From another thread: fail a transfer blocked on a lost peer (the transport is opened anew after) and a
        generation waiting for weights; an earlier failed receive no longer fails the retried step's waits."""
        self.loads.cancel()
        if self.receiver is not None:
            self.receiver.cancel()
