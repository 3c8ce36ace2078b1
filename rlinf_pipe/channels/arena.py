"""Shared memory for the large buffers of channel items between a producer and its consumers on one node.

A producer owns one arena: an anonymous shared-memory file (`memfd`, so a killed process leaves nothing behind
in /dev/shm, and its size is not bound by /dev/shm's) that consumers on its node map through
`/proc/<pid>/fd/<fd>`. A buffer of at least `SHARED_MIN_BYTES` bound for such a consumer is copied once into a
free region of the arena and only its place travels on the socket; the consumer hands the app arrays viewing that
region, leased: the region stays the consumer's until the last array viewing it is gone (`Lease.__del__`), then it
is released back to the producer with the next report. Over a socket the same bytes cost a copy into the kernel
and one out of it in each process. When the arena is full, a buffer goes on the socket as before.
"""

from __future__ import annotations

import logging
import mmap
import os
import uuid
from collections import deque
from typing import Any, Sequence

import msgspec
import numpy as np

log = logging.getLogger(__name__)
SHARED_MIN_BYTES = 64 * 1024  # smaller buffers go on the socket (copying them there costs less than a lease)
ALIGN = 64  # regions start on cache lines


def process_start(pid: int) -> int | None:
    """When process `pid` started (clock ticks after boot: with the pid, names one process for the machine's
    uptime), or None if no process `pid` is running (none, or one that exited and is not yet reaped: its memory,
    mappings included, is gone)."""
    try:
        with open(f"/proc/{pid}/stat", "rb") as stat:
            fields = stat.read().rpartition(b")")[2].split()  # (after the command name, which may hold anything)
    except OSError:
        return None
    return None if fields[0] in (b"Z", b"X") else int(fields[19])  # (state, then starttime: fields 3 and 22)


def this_process() -> tuple[int, int] | None:
    """This process's pid and start (`process_start`), or None where /proc does not say."""
    start = process_start(os.getpid())
    return None if start is None else (os.getpid(), start)


class ArenaRecord(msgspec.Struct, frozen=True):
    """How a consumer on the producer's node maps its arena."""

    path: str  # /proc/<pid>/fd/<fd> of the producer's memfd
    name: str  # the memfd's name, checked on opening (a reused pid must not map another process's memory)
    size: int


class Allocator:
    """First-fit allocation of regions in `[0, size)`: free regions are reused lowest first, so the memory an
    arena touches stays near the bytes in flight at once."""

    def __init__(self, size: int):
        self.size = size
        self._free: list[list[int]] = [[0, size]] if size else []  # [offset, length], sorted, never adjacent
        self._used: dict[int, int] = {}  # offset -> length

    @property
    def used_bytes(self) -> int:
        return sum(self._used.values())

    def alloc(self, nbytes: int) -> int | None:
        """The offset of a free region of `nbytes` (rounded up to `ALIGN`), or None if none is large enough."""
        need = max(1, -(-nbytes // ALIGN)) * ALIGN
        for i, region in enumerate(self._free):
            offset, length = region
            if length >= need:
                if length == need:
                    del self._free[i]
                else:
                    region[0], region[1] = offset + need, length - need
                self._used[offset] = need
                return offset
        return None

    def free(self, offset: int) -> bool:
        """Return a region; False if `offset` is not one in use (nothing changes)."""
        length = self._used.pop(offset, None)
        if length is None:
            return False
        i = 0
        while i < len(self._free) and self._free[i][0] < offset:
            i += 1
        self._free.insert(i, [offset, length])
        if i + 1 < len(self._free) and offset + length == self._free[i + 1][0]:  # merge with the next
            self._free[i][1] += self._free.pop(i + 1)[1]
        if i > 0 and self._free[i - 1][0] + self._free[i - 1][1] == offset:  # ... and the previous
            self._free[i - 1][1] += self._free.pop(i)[1]
        return True


class SharedArena:
    """The producer's arena: copies buffers in and gives their regions back when consumers release them."""

    def __init__(self, size: int, label: str = ""):
        self.name = f"rlp-arena-{uuid.uuid4().hex[:12]}"
        self.label = label  # whose arena it is, for the log
        self.overflow_bytes = 0  # bytes of large buffers that found no room (they went over the socket)
        self._fd = os.memfd_create(self.name, os.MFD_CLOEXEC)
        try:
            os.ftruncate(self._fd, size)  # (pages are only allocated when written)
            self._map = mmap.mmap(self._fd, size)
        except BaseException:
            os.close(self._fd)
            raise
        self._bytes = np.frombuffer(self._map, dtype=np.uint8)
        self.allocator = Allocator(size)
        self.record = ArenaRecord(f"/proc/{os.getpid()}/fd/{self._fd}", self.name, size)

    @classmethod
    def create(cls, size: int, label: str = "") -> "SharedArena | None":
        """An arena of `size` bytes, or None where there is none (size 0, or no memfd: not Linux)."""
        if size <= 0 or not hasattr(os, "memfd_create"):
            return None
        try:
            return cls(size, label)
        except OSError as exc:
            log.warning("channel shared memory unavailable (%s): large items go over sockets", exc)
            return None

    def place(self, buffers: Sequence[Any]) -> tuple[list[Any], list[Any], list[int], int]:
        """Copy an item's large `buffers` in if there is room for all of them (else nothing is copied): (a place
        per buffer, None for one that travels as a frame and [offset, length] for a region; the frames; the
        regions' offsets; the bytes of large buffers that found no room)."""
        sizes = [memoryview(buffer).nbytes for buffer in buffers]
        offsets: dict[int, int] = {}  # buffer index -> region
        for i, nbytes in enumerate(sizes):
            if nbytes >= SHARED_MIN_BYTES:
                offset = self.allocator.alloc(nbytes)
                if offset is None:  # no room for the whole item: it all travels as frames
                    for taken in offsets.values():
                        self.allocator.free(taken)
                    missed = sum(n for n in sizes if n >= SHARED_MIN_BYTES)
                    return [None] * len(buffers), list(buffers), [], missed
                offsets[i] = offset
        places: list[Any] = []
        frames: list[Any] = []
        for i, buffer in enumerate(buffers):
            if i in offsets:
                start, nbytes = offsets[i], sizes[i]
                self._bytes[start:start + nbytes] = np.frombuffer(buffer, dtype=np.uint8)  # (numpy drops the GIL)
                places.append([start, nbytes])
            else:
                places.append(None)
                frames.append(buffer)
        return places, frames, list(offsets.values()), 0

    def note_overflow(self, nbytes: int) -> None:
        """`nbytes` of large buffers go over the socket for want of room (the first time, a warning says so)."""
        if not self.overflow_bytes:
            log.warning(
                "%s: no room in its %d MiB of shared memory (%d MiB held by consumers); large buffers go over the "
                "socket until consumers release some. Consumers that keep many items pin it, and an item larger than "
                "it never fits: raise the channel's "
                "shared_bytes (in a run: runner.channel_shared_mb) if this lasts (stats()['shared_bytes_overflow'] "
                "counts what went over the socket).",
                self.label or "a channel", self.allocator.size >> 20, self.allocator.used_bytes >> 20,
            )
        self.overflow_bytes += nbytes

    def free(self, offset: int) -> bool:
        return self.allocator.free(offset)

    def close(self) -> None:
        """Consumers that have not mapped the arena yet no longer can, and this process unmaps it: its memory goes
        once no consumer maps it either. Nothing may be written afterwards."""
        if self._fd >= 0:
            os.close(self._fd)
            self._fd = -1
            self._bytes = np.empty(0, dtype=np.uint8)
            try:
                self._map.close()
            except BufferError:  # (a view of it is still alive somewhere: the mapping goes with it)
                pass


class Lease:
    """One region of a mapped arena, as numpy sees it (`__array_interface__`): every array and tensor made from
    it keeps it alive, and the region is released when the last of them goes."""

    __slots__ = ("__array_interface__", "_offset", "_released", "_mapping")

    def __init__(self, mapping: np.ndarray, offset: int, nbytes: int, released: deque[int]):
        self.__array_interface__ = {
            "shape": (nbytes,), "typestr": "|u1", "data": (mapping.ctypes.data + offset, False), "version": 3,
        }
        self._offset, self._released, self._mapping = offset, released, mapping

    def __del__(self) -> None:
        self._released.append(self._offset)  # (any thread, at any time: a deque's append is atomic)


class ArenaView:
    """A consumer's mapping of one producer's arena."""

    def __init__(self, mapping: np.ndarray):
        self._mapping = mapping
        self.released: deque[int] = deque()  # offsets whose leases are gone, not yet reported
        self._lease_bytes = 0  # the size of the last region leased

    @classmethod
    def open(cls, record: ArenaRecord) -> "ArenaView | None":
        """Map the arena `record` names, or None if this process cannot (another node, another user, a producer
        gone): its items then come over the socket."""
        try:
            if record.name not in os.readlink(record.path):
                return None
            fd = os.open(record.path, os.O_RDWR)
            try:
                if os.fstat(fd).st_size != record.size:
                    return None
                mapping = mmap.mmap(fd, record.size)
            finally:
                os.close(fd)
            # A forked child must not read regions this process may release (the producer would reuse them under
            # it): it does not inherit the mapping, and crashes on reading it instead of reading wrong bytes.
            mapping.madvise(mmap.MADV_DONTFORK)
        except (OSError, ValueError):
            return None
        return cls(np.frombuffer(mapping, dtype=np.uint8))

    def lease(self, offset: int, nbytes: int) -> np.ndarray:
        """A writable uint8 array over `[offset, offset + nbytes)`, released when no view of it is left."""
        if offset < 0 or offset + nbytes > len(self._mapping):
            raise ValueError(f"region [{offset}, {offset + nbytes}) is outside the arena ({len(self._mapping)} bytes)")
        self._lease_bytes = nbytes
        return np.asarray(Lease(self._mapping, offset, nbytes, self.released))

    def filling(self) -> bool:
        """Whether the regions released and not yet reported are about a quarter of the arena (judged by the size
        of the last lease): the producer may soon find it full."""
        return len(self.released) * self._lease_bytes * 4 >= len(self._mapping)

    def take_released(self) -> list[int]:
        """The offsets released since the last call."""
        out: list[int] = []
        while self.released:
            out.append(self.released.popleft())
        return out
