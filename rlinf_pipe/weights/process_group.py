"""Weight transport over a process group: the actor's gathering rank broadcasts each bucket to every receiver.

The sender (rank 0) and every rollout and log-prob worker join one group of their own (its own TCPStore; separate
from each component's torch.distributed world). A version is nothing but bucket broadcasts in layout order: no
headers, no pickling, no allocation. Both sides keep a ring of two bucket buffers: the sender packs bucket i+1
while bucket i is on the wire; a receiver loads bucket i while bucket i+1 arrives, and posts bucket i+2 into the
slot of bucket i only after loading it returned.

`backend` is the process group's: `gloo` (CPU buffers; what runs without GPUs).
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass
from datetime import timedelta
from typing import Any

import torch

from rlinf_pipe.weights.api import LoadBucket, LoadedWeights, WeightReceiver, WeightSender, WeightVersion
from rlinf_pipe.weights.checks import WeightSyncError
from rlinf_pipe.weights.layout import WeightLayout, check_bucket, end_of_stream, pack_bucket, tensor_views

BACKENDS = ("gloo",)


@dataclass(frozen=True)
class Rendezvous:
    """Where a weight group meets: the sender's address and a free port on its node, and the member count."""

    addr: str
    port: int
    world: int
    backend: str = "gloo"
    timeout_s: float = 300.0


class _Ring:
    """A process group of the weight transport and its two bucket buffers (this process is `rank`)."""

    def __init__(self, rendezvous: Rendezvous, rank: int, layout: WeightLayout):
        import torch.distributed as dist

        if rendezvous.backend not in BACKENDS:
            raise WeightSyncError(f"weight transport backend {rendezvous.backend!r} is not one of {BACKENDS}")
        timeout = timedelta(seconds=rendezvous.timeout_s)
        self.store = dist.TCPStore(rendezvous.addr, rendezvous.port, rendezvous.world, rank == 0, timeout=timeout)
        self.group: Any = dist.ProcessGroupGloo(self.store, rank, rendezvous.world, timeout)
        self.layout = layout
        self.slots = [torch.empty(layout.max_bucket_bytes, dtype=torch.uint8) for _ in range(2)]

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
        in_flight: list[Any] = [None, None]
        try:
            for index, bucket in enumerate(layout.buckets):
                if in_flight[index % 2] is not None:
                    in_flight[index % 2].wait()
                pack_bucket(bucket, self.ring.buffer(index), stream, layout.torch_dtype, version, checksum)
                in_flight[index % 2] = self.ring.broadcast(index)
            end_of_stream(stream)
        finally:
            for work in in_flight:
                if work is not None:
                    work.wait()
        return WeightVersion(version, layout.num_bytes, layout.num_tensors)


class ProcessGroupReceiver(WeightReceiver):
    """A receiving member (`rank` >= 1) of the weight group."""

    transport = "broadcast"

    def __init__(self, rendezvous: Rendezvous, rank: int, layout: WeightLayout):
        if rank < 1:
            raise ValueError(f"receivers have ranks >= 1 (rank 0 sends), got {rank}")
        self.ring = _Ring(rendezvous, rank, layout)

    def receive(self, published: WeightVersion, load_bucket: LoadBucket, verify: bool = False) -> LoadedWeights:
        layout, version = self.ring.layout, published.version
        buckets = layout.buckets
        posted = [self.ring.broadcast(i) for i in range(min(2, len(buckets)))]
        errors: list[str] = []
        for index, bucket in enumerate(buckets):
            posted[index].wait()
            buffer = self.ring.buffer(index)
            error = check_bucket(index, bucket, buffer, version, verify)
            if error:
                errors.append(error)
            elif not errors:
                load_bucket(tensor_views(bucket, buffer, layout.torch_dtype))
            if index + 2 < len(buckets):  # this slot is free again: the bucket after next arrives into it
                posted.append(self.ring.broadcast(index + 2))
        if errors:
            raise WeightSyncError(f"weight broadcast of version {version}: " + "; ".join(errors))
        return LoadedWeights(version, layout.num_bytes, layout.num_tensors, len(buckets))
