"""Per-device locks for time-shared GPUs: two components never run on the same GPU at the same time.

`DeviceLocks` is one Ray actor per job. The workers of a GPU set taken in turns get a `DeviceShare` of it and wrap
each device-occupying phase (wake + generate + sleep, onload + compute + offload) in `async with share.hold(devices,
owner):`; a component whose GPUs are its own gets `DeviceShare()`, whose holds do nothing. A request is granted
when no other holder has any of its devices and no earlier waiting request wants one of them (first come, first
served per device: no starvation, and a multi-device request is granted all at once, so two of them never
deadlock).

Ranks that compute together while holding their GPUs take the lock as one `gang`: the tensor- and pipeline-parallel
ranks of a log-prob replica each ask for the replica's GPUs (all of them) under one name per group, the actor's
ranks for their own under "actor". The first rank to ask queues as above; once the gang holds its devices, the rest
of its ranks are granted as soon as no other holder has theirs, ahead of the queue. Otherwise a rank holding its
GPU inside a collective would wait for a sibling queued behind an engine that waits for that GPU: a deadlock. A
holder is re-entrant (the same owner, or gang, again), and gives its devices back when its last hold is released.
A lost worker's queued requests are dropped (`forfeit`, `reset`): Ray runs a killed caller's request on, and once
granted nobody would release it.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Awaitable, Callable, Sequence
from contextlib import asynccontextmanager
from dataclasses import dataclass, field
from typing import Any

import ray


class LockRequestDropped(RuntimeError):
    """A queued request was dropped: its owner was lost (`forfeit`), or the table was reset."""


@dataclass
class _Request:
    ticket: int
    devices: frozenset[int]
    holder: str
    owner: str
    dropped: bool = False


@dataclass
class _Hold:
    depth: int = 0
    members: set[str] = field(default_factory=set)  # the owners inside (a gang's ranks)


@ray.remote(num_cpus=0)
class DeviceLocks:
    """The job's device lock table (a Ray actor): device id -> holder (an owner, or a gang of owners)."""

    def __init__(self) -> None:
        self._holder: dict[int, str] = {}
        self._holds: dict[str, _Hold] = {}
        self._cond = asyncio.Condition()
        self._queue: list[_Request] = []
        self._ticket = 0

    def _grantable(self, request: _Request) -> bool:
        if any(self._holder.get(d, request.holder) != request.holder for d in request.devices):
            return False
        if request.holder in self._holds:  # re-entrant, or a gang already running: ahead of the queue
            return True
        earlier = self._queue[:self._queue.index(request)]
        return not any(r.devices & request.devices for r in earlier)

    async def acquire(self, devices: list[int], owner: str, gang: str | None = None) -> None:
        """Wait until `devices` are `owner`'s (with `gang`: its gang's, shared with the gang's other ranks)."""
        async with self._cond:
            self._ticket += 1
            request = _Request(self._ticket, frozenset(devices), gang or owner, owner)
            self._queue.append(request)
            try:
                await self._cond.wait_for(lambda: request.dropped or self._grantable(request))
            finally:
                self._queue.remove(request)
                self._cond.notify_all()
            if request.dropped:  # (Ray runs a killed caller's request on: granted, it would never be released)
                raise LockRequestDropped(f"{owner}'s request for devices {sorted(devices)} was dropped")
            for d in devices:
                self._holder[d] = request.holder
            hold = self._holds.setdefault(request.holder, _Hold())
            hold.depth += 1
            hold.members.add(owner)

    async def release(self, owner: str, gang: str | None = None) -> None:
        """End one hold of `owner` (or its gang); the last one gives back every device the holder took."""
        async with self._cond:
            holder = gang or owner
            hold = self._holds.get(holder)
            if hold is not None:
                hold.depth -= 1
                if hold.depth <= 0:
                    self._drop(holder)
            self._cond.notify_all()

    def _drop(self, holder: str) -> None:
        self._holds.pop(holder, None)
        for device in [d for d, h in self._holder.items() if h == holder]:
            del self._holder[device]

    async def forfeit(self, owners: list[str]) -> None:
        """Free whatever `owners` hold, alone or in a gang, and drop their queued requests (workers that were lost:
        they never release)."""
        async with self._cond:
            for holder in [h for h, hold in self._holds.items() if hold.members & set(owners) or h in owners]:
                self._drop(holder)
            for request in self._queue:
                request.dropped |= request.owner in owners
            self._cond.notify_all()

    async def reset(self) -> None:
        """Forget every holder and drop every queued request (after a lost worker: its locks would never be
        released; the workers that stayed are idle and hold their devices no more)."""
        async with self._cond:
            self._holder.clear()
            self._holds.clear()
            for request in self._queue:
                request.dropped = True
            self._cond.notify_all()

    def holders(self) -> dict[int, str]:
        """Device id -> its holder (an owner, or a gang)."""
        return dict(self._holder)

    def num_waiting(self) -> int:
        """Requests queued and not yet granted."""
        return len(self._queue)


Hook = Callable[[], Awaitable[None]]


@dataclass(frozen=True)
class DeviceShare:
    """How a component's workers hold their GPUs: in turns with `turns_with` through the job's lock table `locks`
    (one share per GPU set taken in turns, handed to every worker on it), or alone (`locks` None: every hold, take
    and give-back is a no-op). Picklable: it travels to the workers in their constructor arguments."""

    locks: Any = None  # the job's `DeviceLocks` actor
    turns_with: tuple[str, ...] = ()

    @property
    def in_turns(self) -> bool:
        """Whether the GPUs are taken in turns (otherwise they are this component's alone)."""
        return self.locks is not None

    async def take(self, devices: Sequence[int], owner: str, gang: str | None = None) -> None:
        """Wait until `devices` are `owner`'s (or its `gang`'s: see the module docstring)."""
        if self.locks is not None and devices:
            await self.locks.acquire.remote(list(devices), owner, gang)

    async def give_back(self, owner: str, gang: str | None = None) -> None:
        """End one hold of `owner` (or its gang)."""
        if self.locks is not None:
            await self.locks.release.remote(owner, gang)

    @asynccontextmanager
    async def hold(self, devices: Sequence[int], owner: str, gang: str | None = None, *, after_take: Hook | None = None,
                   before_give_back: Hook | None = None) -> AsyncIterator[None]:
        """Hold `devices` for the block. In turns, `after_take` runs once they are taken (an engine wakes) and
        `before_give_back` while they are still held (it sleeps, or hands cached memory back); alone, neither runs."""
        if self.locks is None or not devices:
            yield
            return
        await self.take(devices, owner, gang)
        try:
            if after_take is not None:
                await after_take()
            try:
                yield
            finally:
                if before_give_back is not None:
                    await before_give_back()
        finally:
            await self.give_back(owner, gang)

    async def forfeit(self, owners: list[str]) -> None:
        """Free what lost workers `owners` held or wait for (`DeviceLocks.forfeit`)."""
        if self.locks is not None:
            await self.locks.forfeit.remote(owners)

    async def reset(self) -> None:
        """Forget every holder (`DeviceLocks.reset`)."""
        if self.locks is not None:
            await self.locks.reset.remote()


def device_shares(turns: dict[str, tuple[str, ...]], locks: Any) -> dict[str, DeviceShare]:
    """Each component's share of its GPUs (`RunPlan.turns`: the components each takes turns with); the lock table
    `locks` is the job's, created where some GPU set is taken in turns."""
    return {name: DeviceShare(locks, others) for name, others in turns.items()}
