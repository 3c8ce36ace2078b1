"""The driver's side of weight sync: which calls move version v from the actor into every engine and log-prob
worker, along the plan's routes (`weight_routes`). The bytes never pass through the driver (see
`rlinf_pipe.weights`).

The object store publishes first (at the end of the step that trained the version, while the actor holds its
devices, and at the first sync of a run) and receivers fetch what was published. The group transports
(`broadcast`, `ipc`) send and receive at once: at the start of the step when the engines have GPUs of their own;
when they share the actor's, at the end of the actor phase that trained the version (the actor's state is on its
devices, the engines resume only their weights), and for a run's first version inside an actor phase of its own.

On GPUs of their own the group transports push each later version (`push`): while step s trains, once every
receiver is done with its part of the step, the actor is asked to send version s + 1 once the step ends and the
receivers to take it. The bytes move as soon as training ends, with no Ray call between, and step s + 1's sync
only collects what was moved.
"""

from __future__ import annotations

import asyncio
import logging
import uuid
from collections.abc import Mapping, Sequence

from rlinf_pipe.errors import ConfigError
from rlinf_pipe.runner.devices import ActorPhase
from rlinf_pipe.planning.weight_routes import WeightRoute, gpu_devices, gpu_shared_in_group
from rlinf_pipe.runtime.rendezvous import hand_out, handed_out_ports
from rlinf_pipe.runtime.worker_group import WorkerGroup
from rlinf_pipe.utils.futures import mark_retrieved
from rlinf_pipe.utils.tracing import Tracer
from rlinf_pipe.weights import LoadedWeights, WeightSyncError, WeightVersion
from rlinf_pipe.weights.process_group import GROUP_NAME, Rendezvous
from rlinf_pipe.weights.record import check_loaded
from rlinf_pipe.weights.transport_names import Transport, needs_rendezvous
from rlinf_pipe.workers.actor import ActorWorker
from rlinf_pipe.workers.weight_receiver import WeightReceiverWorker

log = logging.getLogger(__name__)


def _sent_by(sent_by_rank: Sequence[WeightVersion | None], sender: int) -> WeightVersion:
    """What actor rank `sender`, a route's sender, published (its peers publish nothing: None)."""
    sent = sent_by_rank[sender]
    if sent is None:
        raise WeightSyncError(f"actor rank {sender} sends weights along a route but published nothing")
    return sent


class WeightSync:
    """Moves weight versions from the actor's sending ranks to the `receivers` groups (by component name)."""

    def __init__(self, transport: Transport, routes: Sequence[WeightRoute], actor: WorkerGroup[ActorWorker],
                 receivers: dict[str, WorkerGroup[WeightReceiverWorker]], verify: bool, tracer: Tracer,
                 actor_phase: ActorPhase, engines_share_actor: bool, receivers_share_engines: bool = False):
        self.transport, self.routes, self.actor, self.receivers = transport, list(routes), actor, receivers
        self.verify, self.tracer, self.actor_phase = verify, tracer, actor_phase
        self.at_phase_end = engines_share_actor  # group transports move a version when the actor phase ends
        # Inference on the engines' GPUs loads there: a sync never runs beside the engines' generation, nor a push.
        self.beside_generation = not receivers_share_engines
        self.concurrent = needs_rendezvous(transport)
        self.published: WeightVersion | None = None  # object store: the last version published
        self.synced: dict[int, float] = {}  # group transports at phase end: versions moved ahead of their step
        self.pushed: dict[int, asyncio.Future] = {}  # versions pushed in the step that trains them (bytes moved)
        self.loaded: tuple[int, dict[str, float]] | None = None  # the version every receiver holds, and its sync
        self.warned_unverified = False
        self.native = False  # SGLang engines receive through their own ranks (found by `open`)

    async def open(self) -> None:
        """Open both ends at start-up: every receiver checks the actor's layout against its model; a group transport
        forms one group per route (all members join at once). SGLang engines in a broadcast group take the bytes
        as they are, so the layout then has no trailers (the driver checks versions)."""
        self.native = native = self.transport == "broadcast" and any(await asyncio.gather(
            *(group.rank(0).call(WeightReceiverWorker.native_weight_receiver, self.transport)
              for group in self.receivers.values())))
        layout = await self.actor.rank(0).call(ActorWorker.weight_layout, not native)
        backend = await self.actor.rank(0).call(ActorWorker.weight_backend)
        receivers = {n: g.placement for n, g in self.receivers.items()}
        devices = gpu_devices([self.actor.placement, *receivers.values()])
        if self.transport == "broadcast" and backend == "nccl" and (clash := gpu_shared_in_group(
                self.actor.placement, receivers, devices)):
            raise ConfigError(f"runner.weight_sync: broadcast puts the actor's rank 0 and every receiver in one NCCL "
                              f"group, which takes one rank per GPU, but {clash}: use auto")
        rendezvous: dict[int, Rendezvous | None] = {}
        calls = []
        for route in self.routes:
            ranks = await asyncio.gather(*(
                self.receivers[name].rank(r).call(WeightReceiverWorker.weight_group_ranks, self.transport)
                for name, r in route.receivers))
            point = None
            if self.concurrent:
                addr, port = await self._distinct_port(route.sender)
                # (a name of its own each time: SGLang's ranks keep the groups of earlier opens, and a port can come
                # round again)
                point = Rendezvous(addr, port, 1 + sum(ranks), backend if self.transport == "broadcast" else "gloo",
                                   f"{GROUP_NAME}-{port}-{uuid.uuid4().hex[:8]}")
            rendezvous[route.sender] = point
            rank = 1
            for (name, member), taken in zip(route.receivers, ranks, strict=True):
                calls.append(self.receivers[name].rank(member).call(WeightReceiverWorker.open_weights, self.transport,
                                                                    layout, point, rank))
                rank += taken
        replicas = {self.actor.dp_rank_of(route.sender) for route in self.routes}
        await asyncio.gather(self.actor.all.call(ActorWorker.open_weights, self.transport, rendezvous, replicas,
                                                 not native), *calls)

    async def _distinct_port(self, sender: int) -> tuple[str, int]:
        """A rendezvous port on the node of actor rank `sender` that no other rendezvous of this driver drew lately
        (`handed_out_ports`): none binds its port before every route has drawn, and two senders on one node drew
        the same port about once in 70 starts with 8 routes (the second store then fails to bind)."""
        return hand_out(await self.actor.rank(sender).call(ActorWorker.free_port, handed_out_ports()))

    async def publish(self, version: int) -> None:
        """At the end of an actor phase (the actor holds its devices): the object store publishes `version`; when
        engines share the actor's GPUs, a group transport moves it into the receivers now. Nothing otherwise
        (`sync` does it)."""
        if not self.concurrent:
            self.published = await self.actor.leader(0).call(ActorWorker.publish_weights, version, self.verify)
        elif self.at_phase_end:
            self.synced[version] = await self._transfer_traced(version)

    @property
    def pushes(self) -> bool:
        """Whether versions are pushed at the end of the step that trains them (`push`): group transports with the
        receivers on GPUs of their own, all of them ours (SGLang's ranks would wait for a pushed version inside
        their collective, which times out)."""
        return self.concurrent and not self.at_phase_end and not self.native and self.beside_generation

    def after_training(self, version: int, idle: Mapping[str, Sequence[asyncio.Future]]) -> asyncio.Future | None:
        """The hook the step calls as it starts training `version`: where versions are pushed, `version` moves into
        the receivers as soon as that training ends (`push`; returns the transfer, which the next `sync`
        collects). Elsewhere nothing happens here: `publish` moves or publishes it at the end of the actor's phase,
        or the next `sync` moves it."""
        return self.push(version, idle) if self.pushes else None

    def generation_beside(self) -> bool:
        """The hook the step asks before its generation: whether the engines may be asked to generate while their
        sync still loads (they wait for the version): not for a run's first sync (`versions_known`), nor where
        other receivers load on the engines' GPUs."""
        return self.beside_generation and self.versions_known()

    def push(self, version: int, after: Mapping[str, Sequence[asyncio.Future]]) -> asyncio.Future:
        """While the step that trains `version` runs: ask the actor to send it once that step ends, and each
        receiver group (by name) to take it once its calls in `after` are done (the group is then idle). Returns
        the transfer (the bytes moved); `sync(version)` collects it."""
        transfer = asyncio.ensure_future(self._transfer(version, after, trained=True))
        transfer.add_done_callback(mark_retrieved)  # (a step abandoned meanwhile never collects it)
        self.pushed[version] = transfer
        return transfer

    def versions_known(self) -> bool:
        """Whether the driver knows which version every receiver holds (after the first sync since `open`): then a
        sync either moves a version they do not hold, or nothing, and a generation may be asked for beside it (the
        engines wait for the version). The first sync may move the version they were built with once more."""
        return self.loaded is not None

    async def sync(self, version: int) -> dict[str, float]:
        """Load `version` into every receiver (unless the end of the last actor phase, or an earlier sync of the
        same version, did); checks that each loaded all of it. Returns the bytes per receiver."""
        if self.loaded is None or self.loaded[0] != version:
            self.loaded = (version, await self._sync(version))
        return self.loaded[1]

    async def _sync(self, version: int) -> dict[str, float]:
        if version in self.pushed:  # (the driver's span: how long the step waits for it)
            with self.tracer.span("weight_sync", version=version, pushed=True) as args:
                args["bytes"] = nbytes = await self.pushed.pop(version)
            return {"bytes": nbytes}
        if version in self.synced:
            return {"bytes": self.synced.pop(version)}
        if self.concurrent:  # (shared GPUs: the first version of a run, in an actor phase of its own)
            async with self.actor_phase(version):
                return {"bytes": await self._transfer_traced(version)}
        if self.published is None or self.published.version != version:  # the first sync of a run
            async with self.actor_phase(version):
                await self.publish(version)
        published = self.published
        assert published is not None
        with self.tracer.span("weight_sync", version=version) as args:
            await self._check({route.sender: published for route in self.routes}, await self._receive(published))
            args["bytes"] = published.num_bytes
        return {"bytes": float(published.num_bytes)}

    async def _transfer_traced(self, version: int) -> float:
        """`_transfer` with the driver's `weight_sync` span around it (a pushed transfer has none: it runs beside the
        step's training)."""
        with self.tracer.span("weight_sync", version=version) as args:
            args["bytes"] = nbytes = await self._transfer(version)
        return nbytes

    async def _transfer(self, version: int, after: Mapping[str, Sequence[asyncio.Future]] | None = None,
                        trained: bool = False) -> float:
        """Send and receive `version` at once along every route, once every receiver group's calls in `after` are
        done; with `trained` the actor sends once the step training `version` ended. Returns the bytes.

        The actor is asked only when every receiver can take the bytes: a sender waits for late receivers inside
        its first collectives, which time out (`Rendezvous.timeout_s`), and on NCCL the timeout ends the process
        (torch's watchdog), where the engines generating ahead (`runner.max_staleness`) can outlast the step's
        training by minutes."""
        for calls in (after or {}).values():
            for call in calls:
                await asyncio.shield(call)
        sent_by_rank, loaded = await asyncio.gather(
            self.actor.all.call(ActorWorker.publish_weights, version, self.verify, trained),
            self._receive(WeightVersion(version)))
        sent = {route.sender: _sent_by(sent_by_rank, route.sender) for route in self.routes}
        await self._check(sent, loaded)
        return float(next(iter(sent.values())).num_bytes)

    async def _receive(self, published: WeightVersion) -> dict[tuple[str, int], LoadedWeights]:
        names = list(self.receivers)
        results = await asyncio.gather(*(self.receivers[n].all.call(WeightReceiverWorker.receive_weights, published,
                                                                     self.verify) for n in names))
        return {(name, rank): loaded for name, group in zip(names, results, strict=True)
                for rank, loaded in enumerate(group)}

    async def _check(self, sent: dict[int, WeightVersion], loaded: dict[tuple[str, int], LoadedWeights]) -> None:
        """Every receiver loaded exactly what its sender sent; senders of several replicas sent the same bytes. With
        `verify`, receivers that could not see the bytes (SGLang's own ranks) verify by name after the fact."""
        versions = list(sent.values())
        if any(v.checksums != versions[0].checksums for v in versions[1:]):
            raise WeightSyncError(f"weight sync of version {versions[0].version}: the actor's replicas hold different "
                                  "weights (their CRC32s differ)")
        sender_of = {member: route.sender for route in self.routes for member in route.receivers}
        for (name, rank), got in loaded.items():
            check_loaded(sent[sender_of[(name, rank)]], got, f"{name}/{rank}")
        if not self.verify:
            return
        pending = [member for member, got in loaded.items() if not got.verified_by]
        how = await asyncio.gather(*(
            self.receivers[name].rank(rank).call(WeightReceiverWorker.verify_weights, sent[sender_of[(name, rank)]])
            for name, rank in pending))
        unverified = [f"{name}/{rank}" for (name, rank), by in zip(pending, how, strict=True) if not by]
        if unverified and not self.warned_unverified:
            self.warned_unverified = True
            log.warning("runner.verify_weights: %s cannot verify what it loaded (SGLang reads weights back by name "
                        "only for some model classes); its byte and tensor counts are checked", ", ".join(unverified))
