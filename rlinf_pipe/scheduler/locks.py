"""Per-device locks for collocated mode: two components never run on the same GPU at the same time.

`DeviceLocks` is one Ray actor per job. A worker wraps each device-occupying phase (wake + generate + sleep,
onload + compute + offload) in `async with device_lock(locks, devices, owner):`; the lock is granted when no
other owner holds any of those devices, in request order (no starvation, and a multi-device request never
deadlocks against another because it is granted all at once). The lock is re-entrant for the same owner.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Callable, Sequence
from contextlib import asynccontextmanager

import ray


@ray.remote(num_cpus=0)
class DeviceLocks:
    """The job's device lock table (a Ray actor): device id -> owner, granted FIFO."""

    def __init__(self) -> None:
        self._owner: dict[int, str] = {}
        self._depth: dict[str, int] = {}
        self._cond = asyncio.Condition()
        self._queue: list[int] = []
        self._ticket = 0

    def _free_for(self, devices: Sequence[int], owner: str) -> bool:
        return all(self._owner.get(d, owner) == owner for d in devices)

    async def acquire(self, devices: list[int], owner: str) -> None:
        async with self._cond:
            self._ticket += 1
            ticket = self._ticket
            self._queue.append(ticket)
            try:
                await self._cond.wait_for(lambda: self._queue[0] == ticket and self._free_for(devices, owner))
            finally:
                self._queue.remove(ticket)
                self._cond.notify_all()
            for d in devices:
                self._owner[d] = owner
            self._depth[owner] = self._depth.get(owner, 0) + 1

    async def release(self, devices: list[int], owner: str) -> None:
        async with self._cond:
            self._depth[owner] = self._depth.get(owner, 1) - 1
            if self._depth[owner] <= 0:
                self._depth.pop(owner, None)
                for d in devices:
                    if self._owner.get(d) == owner:
                        del self._owner[d]
            self._cond.notify_all()

    async def forfeit(self, owners: list[str]) -> None:
        """Free whatever `owners` hold (workers that were lost: they never release)."""
        async with self._cond:
            for device, owner in list(self._owner.items()):
                if owner in owners:
                    del self._owner[device]
            for owner in owners:
                self._depth.pop(owner, None)
            self._cond.notify_all()

    async def reset(self) -> None:
        """Forget every holder (after a lost worker: its locks would never be released; the workers that stayed are
        idle and hold their devices no more)."""
        async with self._cond:
            self._owner.clear()
            self._depth.clear()
            self._cond.notify_all()

    def holders(self) -> dict[int, str]:
        return dict(self._owner)

    def num_waiting(self) -> int:
        """Requests queued and not yet granted."""
        return len(self._queue)


@asynccontextmanager
async def device_lock(locks: object | None, devices: Sequence[int], owner: str,
                      before_release: Callable[[], None] | None = None) -> AsyncIterator[None]:
    """Hold `devices` for `owner` for the block (a no-op when `locks` is None: disaggregated mode); with
    `before_release`, call it while still holding them (e.g. to hand cached device memory back)."""
    if locks is None or not devices:
        yield
        return
    await locks.acquire.remote(list(devices), owner)  # type: ignore[attr-defined]
    try:
        yield
    finally:
        try:
            if before_release is not None:
                before_release()
        finally:
            await locks.release.remote(list(devices), owner)  # type: ignore[attr-defined]
