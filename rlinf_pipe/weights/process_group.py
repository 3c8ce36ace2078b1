"""Weight transport over a process group: the actor's gathering rank broadcasts each bucket to every receiver.

The sender (rank 0) and the receiving processes join one group of their own (a TCP store prefixed with the group's
name, separate from each component's torch.distributed world): gloo with host buffers, or NCCL with device
buffers. SGLang engines join the same group through their own `init_weights_update_group` (SGLang's TP ranks take
consecutive ranks) and receive each bucket as one flattened broadcast, which is why buckets have no padding.

A version is nothing but bucket broadcasts in layout order: no headers, no pickling, no allocation. Both sides keep
a ring of two bucket buffers: the sender packs bucket i+1 while bucket i is on the wire; a receiver loads bucket i
while bucket i+1 arrives, and posts bucket i+2 into the slot of bucket i only after loading it returned.
"""

from __future__ import annotations

import asyncio
import threading
from collections.abc import Iterable
from dataclasses import dataclass
from datetime import timedelta
from typing import Any

import torch

from rlinf_pipe.weights.api import LoadBucket, LoadedWeights, WeightReceiver, WeightSender, WeightVersion
from rlinf_pipe.weights.checks import WeightSyncError
from rlinf_pipe.weights.layout import (
    WeightLayout,
    check_bucket,
    data_crc32,
    end_of_stream,
    pack_bucket,
    tensor_views,
)
from rlinf_pipe.weights.record import VersionRecord

BACKENDS = ("gloo", "nccl")
GROUP_NAME = "rlinf_pipe_weights"


@dataclass(frozen=True)
class Rendezvous:
    """Where a weight group meets: the sender's address and a free port on its node, the member count (ranks), the
    backend, and the group's name (its store prefix)."""

    addr: str
    port: int
    world: int
    backend: str = "gloo"
    group_name: str = GROUP_NAME
    timeout_s: float = 300.0


def join_group(rendezvous: Rendezvous, rank: int) -> Any:
    """This process's member (rank `rank`) of the weight group; collective: every member joins at once.

    The group's keys live under the same prefixes as those of a group torch's `_new_process_group_helper` forms
    from a `PrefixStore(group_name, store)`, which is how SGLang's `init_weights_update_group` joins: the group
    name, then `<group name>/`, then the device type. So SGLang's ranks meet ours in one group."""
    import torch.distributed as dist

    if rendezvous.backend not in BACKENDS:
        raise WeightSyncError(f"weight transport backend {rendezvous.backend!r} is not one of {BACKENDS}")
    timeout = timedelta(seconds=rendezvous.timeout_s)
    store = dist.TCPStore(rendezvous.addr, rendezvous.port, rendezvous.world, rank == 0, timeout=timeout)
    device = "cuda" if rendezvous.backend == "nccl" else "cpu"
    name = rendezvous.group_name
    keys = dist.PrefixStore(f"{device}/", dist.PrefixStore(f"{name}/", dist.PrefixStore(name, store)))
    if rendezvous.backend == "gloo":
        return dist.ProcessGroupGloo(keys, rank, rendezvous.world, timeout)
    options = dist.ProcessGroupNCCL.Options()
    options._timeout = timeout  # noqa: SLF001 - the documented way to set it
    return dist.ProcessGroupNCCL(keys, rank, rendezvous.world, options)


WAIT_SLICE = timedelta(seconds=0.25)  # how often a gloo wait looks whether it was cancelled


class GroupWaits:
    """Waits on a weight group's collectives that another thread can cancel (`cancel()`): a member whose peer was
    lost would otherwise block until the group's timeout. Gloo waits in slices and gives up once cancelled (a
    timed-out gloo wait can be waited on again); NCCL's communicator is aborted, which fails its pending work."""

    def __init__(self, group: Any, backend: str):
        self.group, self.backend = group, backend
        self.cancelled = threading.Event()

    def wait(self, work: Any) -> None:
        if self.backend != "gloo":
            work.wait()
            return
        while True:
            try:
                work.wait(WAIT_SLICE)
                return
            except RuntimeError as exc:
                if "timed out" not in str(exc):
                    raise
                if self.cancelled.is_set():
                    raise WeightSyncError("weight transfer abandoned: a member of the weight group was lost") from None

    def cancel(self) -> None:
        self.cancelled.set()
        if self.backend == "nccl":
            self.group.abort()


def ring_device(backend: str) -> torch.device:
    """Where a member's bucket buffers live: the GPU for NCCL, host memory for gloo."""
    return torch.device("cuda", torch.cuda.current_device()) if backend == "nccl" else torch.device("cpu")


class _Ring:
    """A weight group member and its two bucket buffers."""

    def __init__(self, rendezvous: Rendezvous, rank: int, layout: WeightLayout):
        self.group = join_group(rendezvous, rank)
        self.waits = GroupWaits(self.group, rendezvous.backend)
        self.layout = layout
        device = ring_device(rendezvous.backend)
        self.slots = [torch.empty(layout.max_bucket_bytes, dtype=torch.uint8, device=device) for _ in range(2)]

    def buffer(self, index: int) -> torch.Tensor:
        return self.slots[index % 2][: self.layout.buckets[index].nbytes]

    def broadcast(self, index: int) -> Any:
        return self.group.broadcast(self.buffer(index), 0)


class ProcessGroupSender(WeightSender):
    """Rank 0 of the weight group: packs each bucket into a ring slot and broadcasts it."""

    transport = "broadcast"

    def __init__(self, rendezvous: Rendezvous, layout: WeightLayout):
        self.ring = _Ring(rendezvous, 0, layout)

    def publish(self, version: int, tensors: Iterable[tuple[str, torch.Tensor]], checksum: bool = False) -> WeightVersion:
        layout = self.ring.layout
        stream = iter(tensors)
        record = VersionRecord(layout, checksum)
        in_flight: list[Any] = [None, None]
        try:
            for index, bucket in enumerate(layout.buckets):
                if in_flight[index % 2] is not None:
                    self.ring.waits.wait(in_flight[index % 2])
                buffer = self.ring.buffer(index)
                record.packed(bucket, buffer, pack_bucket(bucket, buffer, stream, layout.torch_dtype, version,
                                                          checksum))
                in_flight[index % 2] = self.ring.broadcast(index)
            end_of_stream(stream)
        finally:
            for work in in_flight:
                if work is not None:
                    self.ring.waits.wait(work)
        return record.version(version)

    def cancel(self) -> None:
        self.ring.waits.cancel()


class ProcessGroupReceiver(WeightReceiver):
    """A receiving member (`rank` >= 1) of the weight group."""

    transport = "broadcast"

    def __init__(self, rendezvous: Rendezvous, rank: int, layout: WeightLayout):
        if rank < 1:
            raise ValueError(f"receivers have ranks >= 1 (rank 0 sends), got {rank}")
        self.ring = _Ring(rendezvous, rank, layout)

    async def receive(self, published: WeightVersion, load_bucket: LoadBucket, verify: bool = False) -> LoadedWeights:
        layout, version = self.ring.layout, published.version
        buckets = layout.buckets
        posted = [self.ring.broadcast(i) for i in range(min(2, len(buckets)))]
        errors: list[str] = []
        crcs: list[int] = []
        for index, bucket in enumerate(buckets):
            await asyncio.to_thread(self.ring.waits.wait, posted[index])
            buffer = self.ring.buffer(index)
            error = check_bucket(index, bucket, buffer, version, verify)
            if error:
                errors.append(error)
            elif not errors:
                if verify:
                    crcs.append(data_crc32(bucket, buffer))
                await load_bucket(tensor_views(bucket, buffer, layout.torch_dtype))
            if index + 2 < len(buckets):  # this slot is free again: the bucket after next arrives into it
                posted.append(self.ring.broadcast(index + 2))
        if errors:
            raise WeightSyncError(f"weight broadcast of version {version}: " + "; ".join(errors))
        return LoadedWeights(version, layout.num_bytes, layout.num_tensors, len(buckets), tuple(crcs),
                             "crc32" if verify else "")

    def cancel(self) -> None:
        self.ring.waits.cancel()
