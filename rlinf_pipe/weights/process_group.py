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
    NamedTensors,
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


def join_group(rendezvous: Rendezvous, rank: int, store: Any) -> Any:
    """This process's member (rank `rank`) of the weight group, meeting through `store` (the group's TCP store);
    collective: every member joins at once.

    The group's keys live under the same prefixes as those of a group torch's `_new_process_group_helper` forms
    from a `PrefixStore(group_name, store)`, which is how SGLang's `init_weights_update_group` joins: the group
    name, then `<group name>/`, then the device type. So SGLang's ranks meet ours in one group."""
    import torch.distributed as dist

    timeout = timedelta(seconds=rendezvous.timeout_s)
    device = "cuda" if rendezvous.backend == "nccl" else "cpu"
    name = rendezvous.group_name
    keys = dist.PrefixStore(f"{device}/", dist.PrefixStore(f"{name}/", dist.PrefixStore(name, store)))
    if rendezvous.backend == "gloo":
        return dist.ProcessGroupGloo(keys, rank, rendezvous.world, timeout)
    options = dist.ProcessGroupNCCL.Options()
    options._timeout = timeout  # noqa: SLF001 - the documented way to set it
    return dist.ProcessGroupNCCL(keys, rank, rendezvous.world, options)


WAIT_SLICE = timedelta(seconds=0.25)  # how often a gloo wait looks whether it was cancelled
SENDING, CANCELLED = b"sending", b"cancelled"  # what a version's key in the group's store says


class GroupMember:
    """This process's member of a weight group (`rank`; collective: every member joins at once).

    Receivers post a version's collectives only once the sender announced it (`announce` / `await_sender`, one key
    per version in the group's store): a receive asked for long before the version is trained (`WeightSync.push`)
    waits on the store, never in a collective, whose timeout would fail it. The waits can be cancelled from another
    thread (`cancel()`): a member whose peer was lost would otherwise block until the group's timeout. Gloo waits in
    slices and gives up once cancelled (a timed-out gloo wait can be waited on again); NCCL's communicator is
    aborted, which fails its pending work; a wait for the sender is woken by a key saying so."""

    def __init__(self, rendezvous: Rendezvous, rank: int):
        import torch.distributed as dist

        if rendezvous.backend not in BACKENDS:
            raise WeightSyncError(f"weight transport backend {rendezvous.backend!r} is not one of {BACKENDS}")
        self.rendezvous, self.backend = rendezvous, rendezvous.backend
        self.device = ring_device(rendezvous.backend)  # (the opening thread's GPU: where its buffers live)
        store = dist.TCPStore(rendezvous.addr, rendezvous.port, rendezvous.world, rank == 0,
                              timeout=timedelta(seconds=rendezvous.timeout_s))
        self.group = join_group(rendezvous, rank, store)
        self.versions = dist.PrefixStore(f"{rendezvous.group_name}/versions/", store)
        self.count = 0  # versions announced (the sender) or awaited (a receiver)
        self.awaiting = False  # a receiver's thread waits for the sender's announcement
        self.cancelled = threading.Event()

    def wait(self, work: Any, host: bool = False) -> None:
        """Wait for a collective. On NCCL `work.wait()` only makes this thread's CUDA stream wait for it (what a
        sender needs: its next copy into the slot is ordered after the broadcast); with `host` the thread also
        blocks until the bytes are in (a receiver reads the bucket next: off its event loop, and `cancel`'s abort of
        the communicator ends the wait)."""
        if self.backend != "gloo":
            work.wait()
            if host:  # (this thread's own current device may be another: a new thread starts on GPU 0)
                torch.cuda.current_stream(self.device).synchronize()
                self._check_cancelled()
            return
        while True:
            try:
                work.wait(WAIT_SLICE)
                return
            except RuntimeError as exc:
                if "timed out" not in str(exc):
                    raise
                self._check_cancelled()

    def announce(self) -> None:
        """The sender: the next version's collectives are about to be posted."""
        self.count += 1
        self.versions.set(str(self.count), SENDING)

    def await_sender(self) -> None:
        """A receiver: block until the sender announced the next version (or the wait is cancelled)."""
        import torch.distributed as dist

        self.count += 1
        key = str(self.count)
        self.awaiting = True
        try:
            while True:
                self._check_cancelled()
                try:
                    said = self.versions.get(key)  # (waits for the key, up to the store's timeout: the rendezvous's)
                except dist.DistError as exc:
                    if "timeout" not in str(exc):
                        raise WeightSyncError(f"weight transfer: the weight group's sender is gone ({exc})") from None
                    continue
                if said == CANCELLED:
                    self._check_cancelled()
                return
        finally:
            self.awaiting = False

    def _check_cancelled(self) -> None:
        if self.cancelled.is_set():
            raise WeightSyncError("weight transfer abandoned: a member of the weight group was lost")

    def cancel(self) -> None:
        self.cancelled.set()
        if self.backend == "nccl":
            self.group.abort()
        if self.awaiting:
            self._wake(str(self.count), str(self.count + 1))

    def _wake(self, *keys: str) -> None:
        """Wake a wait for the sender with keys saying it was cancelled (through a connection of its own: the
        waiting thread holds the member's); nothing to wake when the store is gone with the sender (the wait has
        failed then)."""
        import torch.distributed as dist

        r = self.rendezvous
        try:
            store = dist.TCPStore(r.addr, r.port, r.world, False, timeout=timedelta(seconds=2),
                                  wait_for_workers=False)
            versions = dist.PrefixStore(f"{r.group_name}/versions/", store)
            for key in keys:
                if key != "0" and not versions.check([key]):
                    versions.set(key, CANCELLED)
        except (RuntimeError, dist.DistError):
            pass


def ring_device(backend: str) -> torch.device:
    """Where a member's bucket buffers live: the GPU for NCCL, host memory for gloo."""
    return torch.device("cuda", torch.cuda.current_device()) if backend == "nccl" else torch.device("cpu")


class _Ring:
    """A weight group member and its two bucket buffers."""

    def __init__(self, rendezvous: Rendezvous, rank: int, layout: WeightLayout):
        self.member = GroupMember(rendezvous, rank)
        self.layout = layout
        self.slots = [torch.empty(layout.max_bucket_bytes, dtype=torch.uint8, device=self.member.device)
                      for _ in range(2)]
        # each bucket's tensors as views into its slot, made once (a version reuses them)
        self.views: list[NamedTensors] = [tensor_views(bucket, self.buffer(index), layout.torch_dtype)
                                          for index, bucket in enumerate(layout.buckets)]

    def buffer(self, index: int) -> torch.Tensor:
        return self.slots[index % 2][: self.layout.buckets[index].nbytes]

    def broadcast(self, index: int) -> Any:
        return self.member.group.broadcast(self.buffer(index), 0)


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
        self.ring.member.announce()
        try:
            for index, bucket in enumerate(layout.buckets):
                if in_flight[index % 2] is not None:
                    self.ring.member.wait(in_flight[index % 2])
                buffer = self.ring.buffer(index)
                views = self.ring.views[index]
                record.packed(views, pack_bucket(bucket, buffer, views, stream, version, checksum))
                in_flight[index % 2] = self.ring.broadcast(index)
            end_of_stream(stream)
        finally:
            for work in in_flight:
                if work is not None:
                    self.ring.member.wait(work)
        return record.version(version)

    def cancel(self) -> None:
        self.ring.member.cancel()


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
        posted = await asyncio.to_thread(self._first_bucket, len(buckets))
        errors: list[str] = []
        crcs: list[int] = []
        for index, bucket in enumerate(buckets):
            if index:
                await asyncio.to_thread(self.ring.member.wait, posted[index], True)
            buffer = self.ring.buffer(index)
            error = check_bucket(index, bucket, buffer, version, verify)
            if error:
                errors.append(error)
            elif not errors:
                if verify:
                    crcs.append(data_crc32(bucket, buffer))
                await load_bucket(list(self.ring.views[index]))
            if index + 2 < len(buckets):  # this slot is free again: the bucket after next arrives into it
                posted.append(self.ring.broadcast(index + 2))
        if errors:
            raise WeightSyncError(f"weight broadcast of version {version}: " + "; ".join(errors))
        return LoadedWeights(version, layout.num_bytes, layout.num_tensors, len(buckets), tuple(crcs),
                             "crc32" if verify else "")

    def _first_bucket(self, count: int) -> list[Any]:
        """In one thread: wait for the sender's announcement, post the first two buckets, wait for the first."""
        self.ring.member.await_sender()
        posted = [self.ring.broadcast(i) for i in range(min(2, count))]
        self.ring.member.wait(posted[0], host=True)
        return posted

    def cancel(self) -> None:
        self.ring.member.cancel()
