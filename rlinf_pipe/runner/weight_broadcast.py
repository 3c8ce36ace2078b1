"""Weight sync over a direct process group (`runner.weight_sync: broadcast`, disaggregated mode).

The actor's gathering rank (rank 0) and every rollout and log-prob worker join one gloo group (its own TCPStore;
separate from each component's torch.distributed world). The bytes of a version follow a fixed `WeightLayout`:
HF-named tensors packed back to back into buckets of about `runner.weight_bucket_mb`, split only between the
groups of tensors that convert together (`convert.hf_weight_groups`), so every bucket loads on its own. The
layout is planned from the model architecture, sent once when the group forms and checked by every receiver then
(a mismatched model fails at startup, not mid-run).

A sync is then nothing but bucket broadcasts: no headers, no pickling, no allocation. Both sides keep a ring of two
bucket buffers: the sender packs bucket i+1 while bucket i is on the wire; a receiver loads bucket i while bucket
i+1 arrives. Every bucket ends with a trailer (version, CRC32 or 0) that receivers check.
"""

from __future__ import annotations

import pickle
import zlib
from collections.abc import Iterable, Iterator
from dataclasses import dataclass
from datetime import timedelta
from typing import Any

import torch

from rlinf_pipe.runner.weight_sync import WeightSyncError

NamedTensors = list[tuple[str, torch.Tensor]]
ALIGN = 64  # bytes; every tensor and the trailer start at a multiple
TRAILER_BYTES = 16  # int64 version, int64 CRC32 of the bucket's tensor bytes (0: not verified)


def _align(n: int) -> int:
    return -(-n // ALIGN) * ALIGN


@dataclass(frozen=True)
class TensorSlot:
    """Where one HF tensor lies in its bucket buffer."""

    name: str
    shape: tuple[int, ...]
    offset: int
    nbytes: int


@dataclass(frozen=True)
class BucketLayout:
    """The tensors of one bucket; `data_bytes` of tensor data (with alignment), then the trailer."""

    slots: tuple[TensorSlot, ...]
    data_bytes: int

    @property
    def nbytes(self) -> int:
        return self.data_bytes + TRAILER_BYTES


@dataclass(frozen=True)
class WeightLayout:
    """The byte layout of one weight version: its dtype and buckets, in stream order."""

    dtype: str
    buckets: tuple[BucketLayout, ...]

    @property
    def num_bytes(self) -> int:
        """Bytes of tensor data (what a version weighs, without alignment and trailers)."""
        return sum(s.nbytes for b in self.buckets for s in b.slots)

    @property
    def max_bucket_bytes(self) -> int:
        return max(b.nbytes for b in self.buckets)

    def names(self) -> list[str]:
        return [s.name for b in self.buckets for s in b.slots]


def plan_weight_layout(arch: Any, dtype: torch.dtype, bucket_bytes: int) -> WeightLayout:
    """Pack the HF tensors of `arch` (a `models.arch.HfArch`) in stream order into buckets of at most
    `bucket_bytes` of data, never splitting a conversion group (a group larger than `bucket_bytes` gets a
    bucket of its own)."""
    from rlinf_pipe.models.convert import hf_weight_groups, hf_weight_shape

    if bucket_bytes < 1:
        raise ValueError(f"bucket_bytes must be >= 1, got {bucket_bytes}")
    element = torch.empty(0, dtype=dtype).element_size()
    buckets: list[BucketLayout] = []
    slots: list[TensorSlot] = []
    offset = 0
    for group in hf_weight_groups(arch):
        shapes = [hf_weight_shape(arch, name) for name in group]
        sizes = [torch.Size(shape).numel() * element for shape in shapes]
        if slots and offset + sum(map(_align, sizes)) > bucket_bytes:
            buckets.append(BucketLayout(tuple(slots), offset))
            slots, offset = [], 0
        for name, shape, nbytes in zip(group, shapes, sizes, strict=True):
            slots.append(TensorSlot(name, shape, offset, nbytes))
            offset += _align(nbytes)
    if slots:
        buckets.append(BucketLayout(tuple(slots), offset))
    return WeightLayout(str(dtype).removeprefix("torch."), tuple(buckets))


def _crc(data: torch.Tensor) -> int:
    return zlib.crc32(memoryview(data.numpy()))


class WeightBroadcastGroup:
    """A gloo group of `world` processes for weight broadcasts from rank 0 (this process is `rank`).

    Rank 0 calls `agree_layout(layout)` and each receiver `agree_layout(None)` once (collective); then every
    sync is `send` on rank 0 and `receive` on the others, called in the same order everywhere."""

    def __init__(self, addr: str, port: int, rank: int, world: int, timeout_s: float = 300.0):
        import torch.distributed as dist

        timeout = timedelta(seconds=timeout_s)
        self.store = dist.TCPStore(addr, port, world, rank == 0, timeout=timeout)
        self.pg = dist.ProcessGroupGloo(self.store, rank, world, timeout)
        self.rank, self.world = rank, world
        self.layout: WeightLayout | None = None
        self._ring: list[torch.Tensor] = []

    def agree_layout(self, layout: WeightLayout | None) -> WeightLayout:
        """Rank 0 sends its layout; receivers get it (collective). Allocates the two bucket buffers."""
        payload = pickle.dumps(layout) if self.rank == 0 else b""
        size = torch.tensor([len(payload)], dtype=torch.int64)
        self.pg.broadcast(size, 0).wait()
        buffer = torch.empty(int(size), dtype=torch.uint8)
        if self.rank == 0:
            buffer.copy_(torch.frombuffer(bytearray(payload), dtype=torch.uint8))
        self.pg.broadcast(buffer, 0).wait()
        self.layout = pickle.loads(buffer.numpy().tobytes())  # noqa: S301 - our own actor, inside the job
        self._ring = [torch.empty(self.layout.max_bucket_bytes, dtype=torch.uint8) for _ in range(2)]
        return self.layout

    def _require_layout(self) -> WeightLayout:
        if self.layout is None:
            raise WeightSyncError("the weight-broadcast group has no layout yet: call agree_layout first")
        return self.layout

    def _views(self, bucket: BucketLayout, buffer: torch.Tensor) -> NamedTensors:
        dtype = getattr(torch, self._require_layout().dtype)
        return [(s.name, buffer[s.offset : s.offset + s.nbytes].view(dtype).view(s.shape)) for s in bucket.slots]

    def send(self, version: int, tensors: Iterable[tuple[str, torch.Tensor]], checksum: bool = False) -> int:
        """Rank 0: pack `tensors` (HF-named, in layout order; views are fine, each is copied before the next is
        drawn) into the buckets and broadcast them; returns the bytes of tensor data sent."""
        layout = self._require_layout()
        stream = iter(tensors)
        in_flight: list[Any] = [None, None]
        for index, bucket in enumerate(layout.buckets):
            slot = index % 2
            if in_flight[slot] is not None:
                in_flight[slot].wait()
            buffer = self._ring[slot][: bucket.nbytes]
            for (name, view), want in zip(self._views(bucket, buffer), bucket.slots, strict=True):
                got_name, tensor = next(stream, (None, None))
                if got_name != name or tuple(tensor.shape) != want.shape:
                    got = "the end of the stream" if got_name is None else f"{got_name!r} {tuple(tensor.shape)}"
                    raise WeightSyncError(f"weight broadcast: the layout expects {name!r} {want.shape}, got {got}")
                view.copy_(tensor)
            trailer = buffer[bucket.data_bytes :].view(torch.int64)
            trailer[0] = version
            trailer[1] = _crc(buffer[: bucket.data_bytes]) if checksum else 0
            in_flight[slot] = self.pg.broadcast(buffer, 0)
        extra = next(stream, None)
        for work in in_flight:
            if work is not None:
                work.wait()
        if extra is not None:
            raise WeightSyncError(f"weight broadcast: {extra[0]!r} is not in the layout (the model changed?)")
        return layout.num_bytes

    def receive(self, version: int, verify: bool = False) -> Iterator[NamedTensors]:
        """Receivers: yield the buckets of `version` as they arrive, as views into the ring buffers. A bucket's
        views are overwritten once the next-but-one bucket is requested: copy them out before asking for the
        next bucket. Raises `WeightSyncError` (after draining the version) on a wrong version or checksum."""
        layout = self._require_layout()
        buckets = layout.buckets
        posted = [self.pg.broadcast(self._ring[i][: b.nbytes], 0) for i, b in enumerate(buckets[:2])]
        errors: list[str] = []
        for index, bucket in enumerate(buckets):
            slot = index % 2
            posted[index].wait()
            buffer = self._ring[slot][: bucket.nbytes]
            sent_version, crc = buffer[bucket.data_bytes :].view(torch.int64).tolist()
            if sent_version != version:
                errors.append(f"bucket {index} carries version {sent_version}, expected {version}")
            elif verify and crc != _crc(buffer[: bucket.data_bytes]):
                errors.append(f"bucket {index} fails its CRC32 check" + ("" if crc else " (the sender sent none)"))
            if not errors:
                yield self._views(bucket, buffer)
            if index + 2 < len(buckets):
                posted.append(self.pg.broadcast(self._ring[slot][: buckets[index + 2].nbytes], 0))
        if errors:
            raise WeightSyncError(f"weight broadcast of version {version}: " + "; ".join(errors))


def check_layout(layout: WeightLayout, arch: Any, who: str) -> None:
    """`WeightSyncError` unless `layout` streams exactly the HF tensors of `arch`, with their shapes, in order."""
    from rlinf_pipe.models.convert import hf_weight_names, hf_weight_shape

    sent = [(s.name, s.shape) for b in layout.buckets for s in b.slots]
    wanted = [(name, hf_weight_shape(arch, name)) for name in hf_weight_names(arch)]
    if sent == wanted:
        return
    first = next((i for i, (a, b) in enumerate(zip(sent, wanted, strict=False)) if a != b), min(len(sent), len(wanted)))
    got = f"{sent[first][0]!r} {sent[first][1]}" if first < len(sent) else "nothing more"
    want = f"{wanted[first][0]!r} {wanted[first][1]}" if first < len(wanted) else "nothing more"
    raise WeightSyncError(
        f"{who}: the actor's weight stream does not match this worker's model: tensor {first} is {got}, this model "
        f"needs {want}. The actor and the rollout/inference models must have the same architecture "
        "(actor.model_path, rollout.model_path)."
    )


def join_as_sender(addr: str, port: int, world: int, arch: Any, dtype: torch.dtype,
                   bucket_bytes: int) -> WeightBroadcastGroup:
    """Form the group as rank 0 and publish the layout of `arch`'s weights in `dtype` (collective)."""
    group = WeightBroadcastGroup(addr, port, 0, world)
    group.agree_layout(plan_weight_layout(arch, dtype, bucket_bytes))
    return group


def join_as_receiver(addr: str, port: int, rank: int, world: int, arch: Any, who: str) -> WeightBroadcastGroup:
    """Join the group as `rank`, receive the sender's layout and check it against this worker's `arch`."""
    group = WeightBroadcastGroup(addr, port, rank, world)
    check_layout(group.agree_layout(None), arch, who)
    return group
