"""Weight transport by IPC handles, between processes on one node (collocated mode): no bytes are copied between
processes. The sender packs each bucket into one of two slots of shared memory (CUDA IPC on GPUs, POSIX shared
memory on CPU) and sends only a handle to it; every receiver maps the slot, loads the bucket from it and reports
done; the sender reuses the slot for the bucket after next once every receiver is done with it.

The handles travel over a small gloo group of the sender and the receiving processes: per bucket a header
broadcast (version, handle length, CUDA or not), the handle's bytes, and a barrier that says the bucket was loaded. On GPUs
the handle is SGLang's "flattened bucket" payload (the torch-pickled `{"flattened_tensor", "metadata"}` with one
metadata record per tensor: name, shape, dtype, byte offsets), which an SGLang engine takes as it is.
"""

from __future__ import annotations

import asyncio
import io
import pickle
import sys
import types
from collections.abc import Iterable
from dataclasses import dataclass, replace
from multiprocessing import shared_memory
from typing import Any

import torch

from rlinf_pipe.utils.shm import SHM_FIX, ShmFull, reserved_block
from rlinf_pipe.weights.api import LoadBucket, LoadedWeights, WeightReceiver, WeightSender, WeightVersion
from rlinf_pipe.weights.checks import WeightSyncError
from rlinf_pipe.weights.layout import (
    BucketLayout,
    NamedTensors,
    WeightLayout,
    check_bucket,
    data_crc32,
    end_of_stream,
    pack_bucket,
    tensor_views,
)
from rlinf_pipe.weights.process_group import GroupMember, Rendezvous
from rlinf_pipe.weights.record import VersionRecord


def bucket_metadata(bucket: BucketLayout, dtype: torch.dtype) -> list[types.SimpleNamespace]:
    """One record per tensor, as SGLang's flattened bucket reads them (byte offsets into the flat buffer)."""
    return [types.SimpleNamespace(name=s.name, shape=torch.Size(s.shape), dtype=dtype, start_idx=s.offset,
                                  end_idx=s.offset + s.nbytes, numel=s.nbytes) for s in bucket.slots]


class _SharedSlot:
    """One slot of shared memory the receivers can map: a CUDA allocation, or a POSIX shared memory block. A block's
    name is removed (`unname`) once every receiver has mapped it: the memory lives on while mapped, and nothing is
    left in /dev/shm when a process of the run is killed."""

    def __init__(self, nbytes: int, device: torch.device):
        self.device = device
        self.shm: shared_memory.SharedMemory | None = None
        self.named = False  # whether the block's name still exists (receivers may still have to map it)
        if device.type == "cuda":
            self.tensor = torch.empty(nbytes, dtype=torch.uint8, device=device)
        else:
            try:
                self.shm = reserved_block(nbytes)
            except ShmFull as exc:
                raise WeightSyncError(
                    f"the ipc weight transport keeps two buckets in shared memory and {exc.strerror}; {SHM_FIX}, "
                    "or lower runner.weight_bucket_mb, or set runner.weight_sync: broadcast") from None
            self.named = True
            self.tensor = torch.frombuffer(self.shm.buf, dtype=torch.uint8, count=nbytes)

    def handle(self, bucket: BucketLayout, dtype: torch.dtype) -> bytes:
        """The bytes a receiver maps this slot's bucket with."""
        metadata = bucket_metadata(bucket, dtype)
        if self.shm is None:
            torch.cuda.current_stream().synchronize()  # the bucket's bytes are in place before anyone maps them
            return cuda_handle({"flattened_tensor": self.tensor[: bucket.nbytes], "metadata": metadata})
        return pickle.dumps({"shm": self.shm.name, "nbytes": bucket.nbytes, "metadata": metadata})

    def unname(self) -> None:
        """Remove the block's name (every receiver has mapped it; they keep their mappings)."""
        if self.shm is not None and self.named:
            self.shm.unlink()
            self.named = False

    def close(self) -> None:
        if self.shm is not None:
            self.unname()
            del self.tensor
            self.shm.close()
            self.shm = None


def cuda_handle(payload: dict[str, Any]) -> bytes:
    """`payload` pickled with torch's CUDA IPC reductions (tensors travel as IPC handles), naming each tensor's GPU
    by its UUID instead of this process's device index: the receiving process may number its GPUs differently
    (another CUDA_VISIBLE_DEVICES). SGLang's schedulers read UUIDs the same way."""
    from multiprocessing.reduction import ForkingPickler

    from torch.multiprocessing import reductions  # (importing it registers torch's reductions with ForkingPickler)

    def reduce(tensor: torch.Tensor) -> tuple[Any, tuple[Any, ...]]:
        rebuild, args = reductions.reduce_tensor(tensor)
        if tensor.is_cuda and isinstance(args[DEVICE_ARG], int):
            uuid = str(torch.cuda.get_device_properties(args[DEVICE_ARG]).uuid)
            args = (*args[:DEVICE_ARG], uuid, *args[DEVICE_ARG + 1 :])
        return rebuild, args

    out = io.BytesIO()
    pickler = ForkingPickler(out, pickle.HIGHEST_PROTOCOL)
    pickler.dispatch_table[torch.Tensor] = reduce
    pickler.dump(payload)
    return out.getvalue()


DEVICE_ARG = 6  # the device's place in the arguments of torch's `rebuild_cuda_tensor` (stable since torch 1.x)


def _rebuild_cuda_tensor(*args: Any) -> torch.Tensor:
    """torch's `rebuild_cuda_tensor`, with the GPU named by its UUID (see `cuda_handle`)."""
    from torch.multiprocessing import reductions

    device = args[DEVICE_ARG]
    if isinstance(device, str):
        matches = [i for i in range(torch.cuda.device_count())
                   if str(torch.cuda.get_device_properties(i).uuid) == device]
        if not matches:
            raise WeightSyncError(f"weight IPC: the sender's GPU {device} is not visible to this process (CUDA IPC "
                                  "needs the sender and the receivers on one node; use runner.weight_sync: broadcast)")
        args = (*args[:DEVICE_ARG], matches[0], *args[DEVICE_ARG + 1 :])
    return reductions.rebuild_cuda_tensor(*args)


class _HandleUnpickler(pickle.Unpickler):
    """Reads a handle: torch's tensor and storage rebuilders, dtypes, sizes and the metadata records, nothing else."""

    ALLOWED = {("types", "SimpleNamespace"), ("collections", "OrderedDict"), ("builtins", "slice")}

    def find_class(self, module: str, name: str) -> Any:
        if (module, name) == ("torch.multiprocessing.reductions", "rebuild_cuda_tensor"):
            return _rebuild_cuda_tensor
        if module == "torch" or module.startswith(("torch.multiprocessing.", "torch._utils", "torch.storage")) or (
                (module, name) in self.ALLOWED):
            return super().find_class(module, name)
        raise WeightSyncError(f"weight IPC: a handle names {module}.{name}, which no handle of ours does")


def read_handle(handle: bytes) -> dict[str, Any]:
    """The payload of a handle (see `_SharedSlot.handle`)."""
    return _HandleUnpickler(io.BytesIO(handle)).load()


def _attach(name: str) -> shared_memory.SharedMemory:
    """Attach to a block another process owns and unlinks. Before Python 3.13 attaching registers the block with
    this process's resource tracker, which would unlink it when this process exits (or, in a child sharing its
    parent's tracker, undo the owner's registration); so the registration is skipped."""
    if sys.version_info >= (3, 13):
        return shared_memory.SharedMemory(name=name, track=False)
    from multiprocessing import resource_tracker

    register = resource_tracker.register
    resource_tracker.register = lambda *args, **kwargs: None
    try:
        return shared_memory.SharedMemory(name=name)
    finally:
        resource_tracker.register = register


class _Mapped:
    """A receiver's view of the slots it has been handed (shared memory blocks stay attached between versions)."""

    def __init__(self) -> None:
        self.blocks: dict[str, shared_memory.SharedMemory] = {}

    def _block(self, name: str) -> shared_memory.SharedMemory:
        """The block named `name`, mapped on first use."""
        block = self.blocks.get(name)
        if block is None:
            block = self.blocks[name] = _attach(name)
        return block

    def attach(self, handle: Handle) -> None:
        """Map the shared memory block a CPU handle names, if not yet mapped: every receiver maps each slot it is
        handed before it reports the bucket done (the sender then removes the block's name), loaded or not."""
        if not handle.cuda:
            self._block(read_handle(handle.data)["shm"])

    def open(self, handle: bytes) -> torch.Tensor:
        """The flat uint8 buffer a handle names (the caller drops it before reporting the bucket done)."""
        payload = read_handle(handle)
        if "flattened_tensor" in payload:
            return payload["flattened_tensor"]
        block = self._block(payload["shm"])
        return torch.frombuffer(block.buf, dtype=torch.uint8, count=payload["nbytes"])

    def close(self) -> None:
        for block in self.blocks.values():
            block.close()
        self.blocks.clear()


def _control(rendezvous: Rendezvous, rank: int) -> GroupMember:
    return GroupMember(replace(rendezvous, backend="gloo"), rank)


@dataclass(frozen=True)
class Handle:
    """One bucket's handle as a receiver gets it: the version, whether the slot is CUDA memory, the bytes."""

    version: int
    cuda: bool
    data: bytes


def _broadcast_bytes(member: GroupMember, header: torch.Tensor, data: bytes | None) -> bytes:
    """Broadcast `header` (`[version, length, cuda]`) then the bytes from rank 0 (`data` None on receivers);
    returns the bytes."""
    member.wait(member.group.broadcast(header, 0))
    buffer = torch.frombuffer(bytearray(data), dtype=torch.uint8) if data is not None else (
        torch.empty(int(header[1]), dtype=torch.uint8))
    member.wait(member.group.broadcast(buffer, 0))
    return data if data is not None else buffer.numpy().tobytes()


class IpcSender(WeightSender):
    """Rank 0 of the control group: packs buckets into two shared slots on `device` and hands out their handles."""

    transport = "ipc"

    def __init__(self, rendezvous: Rendezvous, layout: WeightLayout, device: torch.device):
        self.member = _control(rendezvous, 0)
        self.layout = layout
        self.slots = [_SharedSlot(layout.max_bucket_bytes, device) for _ in range(min(2, len(layout.buckets)))]

    def publish(self, version: int, tensors: Iterable[tuple[str, torch.Tensor]], checksum: bool = False) -> WeightVersion:
        layout = self.layout
        stream = iter(tensors)
        record = VersionRecord(layout, checksum)
        done: list[Any] = [None, None]  # per slot: the barrier that says every receiver loaded its bucket
        self.member.announce()
        try:
            for index, bucket in enumerate(layout.buckets):
                slot = self.slots[index % 2]
                if done[index % 2] is not None:
                    self.member.wait(done[index % 2])
                    slot.unname()  # (every receiver has mapped it)
                buffer = slot.tensor[: bucket.nbytes]
                views = tensor_views(bucket, buffer, layout.torch_dtype)
                record.packed(views, pack_bucket(bucket, buffer, views, stream, version, checksum))
                handle = slot.handle(bucket, layout.torch_dtype)
                header = torch.tensor([version, len(handle), slot.shm is None], dtype=torch.int64)
                _broadcast_bytes(self.member, header, handle)
                done[index % 2] = self.member.group.barrier()
            end_of_stream(stream)
        finally:
            for slot, work in zip(self.slots, done):
                if work is not None:
                    self.member.wait(work)
                    slot.unname()
        return record.version(version)

    def cancel(self) -> None:
        self.member.cancel()

    def close(self) -> None:
        for slot in self.slots:
            slot.close()


class IpcReceiver(WeightReceiver):
    """A receiving member (`rank` >= 1) of the control group. `load_handle` (an engine that maps handles itself,
    such as SGLang) replaces mapping the slot here: it gets each bucket's handle bytes."""

    transport = "ipc"

    def __init__(self, rendezvous: Rendezvous, rank: int, layout: WeightLayout):
        if rank < 1:
            raise ValueError(f"receivers have ranks >= 1 (rank 0 sends), got {rank}")
        self.member = _control(rendezvous, rank)
        self.layout = layout
        self.mapped = _Mapped()

    async def _next(self) -> Handle:
        header = torch.empty(3, dtype=torch.int64)
        data = await asyncio.to_thread(_broadcast_bytes, self.member, header, None)
        return Handle(int(header[0]), bool(header[2]), data)

    async def load_handle(self, index: int, bucket: BucketLayout, handle: Handle, load_bucket: LoadBucket,
                          verify: bool) -> tuple[str | None, int | None]:
        """Map the slot, check its trailer, load it; returns (what is wrong or None, its CRC32 with `verify`)."""
        buffer = self.mapped.open(handle.data)
        try:
            error = check_bucket(index, bucket, buffer, handle.version, verify)
            if error:
                return error, None
            crc = data_crc32(bucket, buffer) if verify else None
            views: NamedTensors = tensor_views(bucket, buffer, self.layout.torch_dtype)
            await load_bucket(views)
            if buffer.is_cuda:  # the load's copies are done before the sender may write the slot again
                torch.cuda.current_stream(buffer.device).synchronize()
            return None, crc
        finally:
            del buffer

    async def receive(self, published: WeightVersion, load_bucket: LoadBucket, verify: bool = False) -> LoadedWeights:
        layout, version = self.layout, published.version
        errors: list[str] = []
        crcs: list[int] = []
        await asyncio.to_thread(self.member.await_sender)
        for index, bucket in enumerate(layout.buckets):
            handle = await self._next()
            self.mapped.attach(handle)
            if handle.version != version:
                errors.append(f"bucket {index} carries version {handle.version}, expected {version}")
            elif not errors:
                error, crc = await self.load_handle(index, bucket, handle, load_bucket, verify)
                if error:
                    errors.append(error)
                elif crc is not None:
                    crcs.append(crc)
            await asyncio.to_thread(lambda: self.member.wait(self.member.group.barrier()))  # done with this bucket
        if errors:
            raise WeightSyncError(f"weight IPC of version {version}: " + "; ".join(errors))
        return LoadedWeights(version, layout.num_bytes, layout.num_tensors, len(layout.buckets), tuple(crcs),
                             "crc32" if verify else "")

    def cancel(self) -> None:
        self.member.cancel()
