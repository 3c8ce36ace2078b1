"""`WeightReceiverWorker`: the receiving end of weight sync, written once for every worker that loads the versions the
actor publishes (the rollout engines, the log-prob workers). The driver opens the transport on each
(`open_weights`), then moves one version a sync (`receive_weights`); a subclass says only what the versions load
into (`weight_target`: an object with a `version` and a `weight_update(version)` session) and, where its engine
receives some transport itself, how (`native_receiver`)."""

from __future__ import annotations

from contextlib import AbstractAsyncContextManager
from typing import Protocol

from rlinf_pipe.models.weight_map import read_hf_arch
from rlinf_pipe.runtime.worker import Worker
from rlinf_pipe.weights import LoadBucket, LoadedWeights, WeightLayout, WeightVersion
from rlinf_pipe.weights.process_group import Rendezvous
from rlinf_pipe.weights.transport_names import Transport
from rlinf_pipe.workers.weight_inbox import NativeReceiver, WeightInbox


class WeightTarget(Protocol):
    """What weight versions load into: a rollout engine, or a log-prob stage's policy."""

    @property
    def version(self) -> int: ...

    def weight_update(self, version: int) -> AbstractAsyncContextManager[LoadBucket]: ...


class WeightReceiverWorker(Worker):
    """A worker that loads the actor's weight versions (see the module docstring)."""

    def __init__(self, model_path: str) -> None:
        super().__init__()
        self.inbox = WeightInbox(self.owner, read_hf_arch(model_path), self.tracer)

    def weight_target(self) -> WeightTarget:
        """What the versions load into."""
        raise NotImplementedError

    def native_receiver(self) -> NativeReceiver | None:
        """The engine's own receiver for a transport, where it has one (None: the standard receivers load into
        `weight_target()`)."""
        return None

    def on_abandon(self) -> None:
        self.inbox.cancel()

    def rewind_weights(self) -> None:
        """The actor went back to a checkpoint: accept an older weight version next."""
        self.inbox.rewind()

    async def wait_for_weights(self, version: int) -> None:
        """Return once `version` is loaded (a sync may still be loading it; `WeightInbox.wait_for`)."""
        await self.inbox.wait_for(version, lambda: self.weight_target().version)

    def weight_group_ranks(self, transport: Transport) -> int:
        """Ranks this worker takes in `transport`'s process group: one, this process."""
        return 1

    def native_weight_receiver(self, transport: Transport) -> bool:
        """Whether the engine receives `transport` with a receiver of its own (never, here)."""
        return False

    async def open_weights(self, transport: Transport, layout: WeightLayout, rendezvous: Rendezvous | None,
                           rank: int) -> None:
        """Join the weight transport at `rank` (checks the actor's layout against this worker's model)."""
        await self.inbox.open(transport, layout, rendezvous, rank, self.native_receiver())

    async def verify_weights(self, published: WeightVersion) -> str:
        """Verify the loaded version where the receiver could not: nothing beyond the receiver's CRC32 ("")."""
        return ""

    async def receive_weights(self, published: WeightVersion, verify: bool = False) -> LoadedWeights:
        """Load `published` into `weight_target()`, bucket by bucket."""
        target = self.weight_target()
        return await self.inbox.receive(published, target.version, target.weight_update, verify)
