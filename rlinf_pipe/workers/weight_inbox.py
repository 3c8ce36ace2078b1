"""A worker's receiving end of weight sync: opened at start-up with the actor's layout, then one version a sync."""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from contextlib import AbstractContextManager
from typing import Any

from rlinf_pipe.utils.tracing import Tracer
from rlinf_pipe.weights import LoadBucket, LoadedWeights, WeightLayout, WeightReceiver, WeightVersion, check_version
from rlinf_pipe.weights.process_group import Rendezvous
from rlinf_pipe.weights.transports import Transport, open_receiver


class WeightInbox:
    """Receives weight versions into a model; `session(version)` is the model's weight-update session (a context
    yielding `load(bucket)`, setting the version on a clean exit)."""

    def __init__(self, owner: str, arch: Any, tracer: Tracer):
        self.owner, self.arch, self.tracer = owner, arch, tracer
        self.receiver: WeightReceiver | None = None  # opened by `open` once the actor's layout is known

    def open(self, transport: Transport, layout: WeightLayout, rendezvous: Rendezvous | None, rank: int) -> None:
        """Join the transport (a process group's rendezvous, when it has one); checks `layout` against the model."""
        self.receiver = open_receiver(transport, layout, self.arch, self.owner, rendezvous, rank)

    async def receive(
        self, published: WeightVersion, current: int,
        session: Callable[[int], AbstractContextManager[LoadBucket]], verify: bool,
    ) -> LoadedWeights:
        """Load `published` (newer than or equal to the `current` version) through `session`."""
        if self.receiver is None:
            raise RuntimeError(f"{self.owner}: weight sync before the weight transport was opened")
        check_version(current, published.version, self.owner)
        receiver = self.receiver

        def receive() -> LoadedWeights:
            with self.tracer.span("weight_sync", version=published.version) as args, \
                    session(published.version) as load:
                loaded = receiver.receive(published, load, verify)
                args["bytes"] = loaded.num_bytes
            return loaded

        return await asyncio.to_thread(receive)
