"""The node's POSIX shared memory (/dev/shm): how much there is, and blocks that fail where it runs out instead of
crashing.

A container's /dev/shm is 64 MiB unless it is given more (Docker's default), where NCCL's shared-memory transport
between the GPUs of a node fails to create its segments ("unhandled system error"), and where a block larger than
what is free is created all the same (tmpfs allocates on write) and kills its process with SIGBUS at the first
write past it, with no message.
"""

from __future__ import annotations

import os
from multiprocessing import shared_memory

SHM_DIR = "/dev/shm"
SMALL_SHM_BYTES = 1 << 30  # below this NCCL's segments (several MiB per pair of GPUs and group) run out
SHM_FIX = ("give it more: `docker run --shm-size=16g` (or `--ipc=host`), on Kubernetes an `emptyDir` volume with "
           "`medium: Memory` mounted at /dev/shm")
MIB = 1 << 20


def shm_space(path: str = SHM_DIR) -> tuple[int, int] | None:
    """(total, free) bytes of the file system at `path`; None where there is none."""
    try:
        stat = os.statvfs(path)
    except OSError:
        return None
    return stat.f_blocks * stat.f_frsize, stat.f_bavail * stat.f_frsize


def small_shm_warning(path: str = SHM_DIR, least_bytes: int = SMALL_SHM_BYTES) -> str:
    """A warning for a GPU worker whose node's /dev/shm holds less than `least_bytes` ("" when it holds enough)."""
    space = shm_space(path)
    if space is None or space[0] >= least_bytes:
        return ""
    return (f"{path} on this node holds only {space[0] / MIB:.0f} MiB: NCCL between the GPUs of a node keeps its "
            f"shared-memory segments there and fails with 'unhandled system error' once it is full; {SHM_FIX}")


class ShmFull(OSError):
    """A shared-memory block could not be given the bytes it needs; the message says how much /dev/shm holds."""


def reserved_block(nbytes: int) -> shared_memory.SharedMemory:
    """A new POSIX shared-memory block of `nbytes` whose pages are all allocated now (`posix_fallocate`), so a full
    /dev/shm raises `ShmFull` here instead of SIGBUS at a later write."""
    block = shared_memory.SharedMemory(create=True, size=max(nbytes, 1))
    try:
        os.posix_fallocate(block._fd, 0, max(nbytes, 1))  # noqa: SLF001 (the block's own descriptor)
    except OSError as exc:
        block.close()
        block.unlink()
        space = shm_space()
        held = "" if space is None else f" ({space[1] / MIB:.0f} MiB free of {space[0] / MIB:.0f} MiB)"
        raise ShmFull(exc.errno, f"{SHM_DIR}{held} cannot hold a shared-memory block of {nbytes / MIB:.1f} MiB: "
                                 f"{exc.strerror}") from None
    return block
