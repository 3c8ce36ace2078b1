"""Endpoint discovery: one small Ray named actor per Ray namespace. It holds channel specs and producer addresses;
payloads never pass through it. The process that creates it (in a run, the driver) gives it the run's channel key
(`gate.py`), which it puts in every spec it hands out."""

from __future__ import annotations

import weakref
from typing import Any

import msgspec
import ray

from rlinf_pipe.errors import ChannelError
from rlinf_pipe.channels.arena import ArenaRecord
from rlinf_pipe.channels.gate import ChannelKey
from rlinf_pipe.utils.ray_guard import disable_auto_init, stop_before_shutdown

REGISTRY_NAME = "rlinf_pipe:channel_registry"


class ChannelSpec(msgspec.Struct, frozen=True):
    """How a channel behaves; fixed when it is created.

    `maxsize` bounds, per producer, the weight of items put but not yet taken by a consumer (None: unbounded).
    `prefetch` is how many items each consumer accepts ahead from each producer.
    `shared_bytes` is the shared memory each producer lends consumers on its node for buffers of at least 64 KiB
    (`arena.py`; 0: every byte goes over the sockets). Only what is in flight at once is ever touched.
    `encrypt` encrypts what goes over the sockets (CURVE; `gate.py`), for networks the cluster does not trust.
    `key` is the run's channel key, which the registry fills in: every peer proves it (`gate.py`).
    """

    name: str
    maxsize: float | None = 64
    num_producers: int | None = None
    prefetch: int = 8
    heartbeat_s: float = 1.0
    peer_timeout_s: float = 30.0
    shared_bytes: int = 64 * 1024 * 1024
    encrypt: bool = False
    key: ChannelKey | None = None


class ProducerRecord(msgspec.Struct, frozen=True):
    """Where a producer listens: ipc for consumers on its node, tcp for the others."""

    id: str
    node_id: str
    ipc: str
    tcp: str
    arena: ArenaRecord | None = None  # its shared memory, for consumers on its node
    closed: bool = False
    ended_through: int = -1  # its last ended step, once closed
    failure: str | None = None  # why it ended with items undelivered (then not `closed`)


@ray.remote(num_cpus=0)
class ChannelRegistry:
    def __init__(self, key: ChannelKey) -> None:
        self.key = key
        self.specs: dict[str, ChannelSpec] = {}
        self.producers: dict[str, dict[str, ProducerRecord]] = {}

    def declare(self, spec: ChannelSpec) -> ChannelSpec:
        """Create the channel with the run's key, or return the existing spec (the caller checks it matches)."""
        return self.specs.setdefault(spec.name, msgspec.structs.replace(spec, key=self.key))

    def spec(self, name: str) -> ChannelSpec | None:
        return self.specs.get(name)

    def add_producer(self, name: str, record: ProducerRecord) -> None:
        self.producers.setdefault(name, {})[record.id] = record

    def close_producer(self, name: str, producer_id: str, ended_through: int, failure: str | None = None) -> None:
        """The producer's end is gone: closed once everything was delivered, or (`failure`) not."""
        record = self.producers.get(name, {}).get(producer_id)
        if record is not None:
            self.producers[name][producer_id] = msgspec.structs.replace(
                record, closed=failure is None, ended_through=ended_through, failure=failure
            )

    def list_producers(self, name: str) -> list[ProducerRecord]:
        return list(self.producers.get(name, {}).values())


_handle: tuple[str, "ray.actor.ActorHandle"] | None = None  # (job@node, handle)
_LIVE_ENDS: weakref.WeakSet = weakref.WeakSet()  # this process's producing and consuming ends (their I/O threads)


def track_end(end: Any) -> None:
    """Remember a channel end (anything with `stop()`) so that it is stopped before Ray shuts down."""
    _LIVE_ENDS.add(end)


def stop_live_ends() -> None:
    """Stop the I/O threads of every channel end of this process: they call into Ray, which must not happen while
    it shuts down (`rlinf_pipe.utils.ray_guard`)."""
    for end in list(_LIVE_ENDS):
        end.stop()


disable_auto_init()  # a channel thread's late call after ray.shutdown() must not start a new Ray
stop_before_shutdown(stop_live_ends)  # nor may one land while it shuts down: that ends the process


def registry() -> "ray.actor.ActorHandle":
    """The registry of this Ray job (created on first use; the first process to use channels owns it, so in a
    run that is the driver, and makes the run's channel key). The handle is kept: Ray removes a named actor once no
    handle to it is left."""
    global _handle
    if not ray.is_initialized():
        raise ChannelError("socket channels need Ray: call ray.init() (or start a Cluster) first")
    context = ray.get_runtime_context()
    job = f"{context.get_job_id()}@{context.get_node_id()}"  # a new cluster reuses job ids, not node ids
    if _handle is None or _handle[0] != job:
        # (the key is used only if this call creates the registry; Ray carries it, on its authenticated connections)
        options = {"name": REGISTRY_NAME, "get_if_exists": True, "lifetime": None}
        actor = ChannelRegistry.options(**options).remote(ChannelKey.new())
        _handle = (job, actor)
    return _handle[1]
