"""A worker's receiving end of weight sync: opened at start-up with the actor's layout, then one version a sync."""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable
from contextlib import AbstractAsyncContextManager
from typing import Any

from rlinf_pipe.utils.tracing import Tracer
from rlinf_pipe.weights import LoadBucket, LoadedWeights, WeightLayout, WeightReceiver, WeightVersion, check_version
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
        with self.tracer.span("weight_sync", version=published.version) as args:
            async with session(published.version) as load:
                loaded = await self.receiver.receive(published, load, verify)
            args["bytes"] = loaded.num_bytes
        self.any_version = False
        return loaded

    def rewind(self) -> None:
        """The actor went back to a checkpoint: the next version received may be older than the loaded one."""
        self.any_version = True

    def cancel(self) -> None:
        """From another thread: fail a transfer blocked on a lost peer (the transport is opened anew after)."""
        if self.receiver is not None:
            self.receiver.cancel()
