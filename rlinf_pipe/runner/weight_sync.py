"""The driver's side of weight sync: which calls move version v from the actor into every engine and log-prob
worker. The bytes never pass through the driver (see `rlinf_pipe.weights`).

A process-group transport (`broadcast`) sends and receives at once. The object store publishes first: at the end
of the step that trained the version, while the actor still holds its devices (collocated), and at the first sync
of a run; receivers then fetch what was published.
"""

from __future__ import annotations

import asyncio
from collections.abc import Sequence

from rlinf_pipe.runner.devices import ActorPhase
from rlinf_pipe.scheduler.worker_group import WorkerGroup
from rlinf_pipe.utils.tracing import Tracer
from rlinf_pipe.weights import LoadedWeights, WeightSyncError, WeightVersion
from rlinf_pipe.weights.process_group import Rendezvous
from rlinf_pipe.weights.transports import Transport, needs_rendezvous


class WeightSync:
    """Moves weight versions from `actor` (its rank 0 gathers and sends) to every member of `receivers`."""

    def __init__(self, transport: Transport, actor: WorkerGroup, receivers: Sequence[WorkerGroup], verify: bool,
                 tracer: Tracer, actor_phase: ActorPhase):
        self.transport, self.actor, self.receivers = transport, actor, list(receivers)
        self.verify, self.tracer, self.actor_phase = verify, tracer, actor_phase
        self.concurrent = needs_rendezvous(transport)
        self.published: WeightVersion | None = None  # object store: the last version published

    async def open(self) -> None:
        """Open both ends at start-up: every receiver checks the actor's layout against its model; a process-group
        transport forms its group (all members join at once)."""
        layout = await self.actor.rank(0).weight_layout()
        rendezvous = None
        if self.concurrent:
            addr, port = await self.actor.rank(0).free_port()
            rendezvous = Rendezvous(addr, port, 1 + sum(group.size for group in self.receivers))
        calls = [self.actor.all.open_weights(self.transport, rendezvous)]
        rank = 1
        for group in self.receivers:
            for member in range(group.size):
                calls.append(group.rank(member).open_weights(self.transport, layout, rendezvous, rank))
                rank += 1
        await asyncio.gather(*calls)

    async def publish(self, version: int) -> None:
        """Object store: publish `version` now (the actor must hold its devices). Nothing for a process group,
        whose sending is part of `sync`."""
        if not self.concurrent:
            self.published = await self.actor.leader(0).publish_weights(version, self.verify)

    async def sync(self, version: int) -> dict[str, float]:
        """Load `version` into every receiver; checks that each loaded all of it. Returns the bytes per receiver."""
        with self.tracer.span("weight_sync", version=version) as args:
            if self.concurrent:
                sent, loaded = await asyncio.gather(
                    self.actor.leader(0).publish_weights(version, self.verify), self._receive(WeightVersion(version))
                )
            else:
                if self.published is None or self.published.version != version:  # the first sync of a run
                    async with self.actor_phase(version):
                        await self.publish(version)
                sent, loaded = self.published, await self._receive(self.published)
            _check_loaded(sent, loaded)
            args["bytes"] = sent.num_bytes
        return {"bytes": float(sent.num_bytes)}

    async def _receive(self, published: WeightVersion) -> list[LoadedWeights]:
        results = await asyncio.gather(*(group.all.receive_weights(published, self.verify) for group in self.receivers))
        return [loaded for group_results in results for loaded in group_results]


def _check_loaded(sent: WeightVersion, loaded: list[LoadedWeights]) -> None:
    """Every receiver loaded exactly what was sent (a version, a byte count and a tensor count)."""
    for i, got in enumerate(loaded):
        if (got.version, got.num_bytes, got.num_tensors) != (sent.version, sent.num_bytes, sent.num_tensors):
            raise WeightSyncError(
                f"weight sync: receiver {i + 1} loaded version {got.version} ({got.num_bytes} bytes, {got.num_tensors} "
                f"tensors), the actor sent version {sent.version} ({sent.num_bytes} bytes, {sent.num_tensors} tensors)"
            )
