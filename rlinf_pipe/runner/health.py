"""The driver's watch over the job's workers while it waits on them: a heartbeat that finds a worker which died or
hung, and the right blame when a stage fails because a peer is gone.

    health = Health(components.groups, timeout_s=30)
    result = await health.guard(call)   # `call`'s result, or the `WorkerLost` of the first worker found lost
"""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable
from typing import TypeVar

from rlinf_pipe.errors import WorkerError, WorkerLost
from rlinf_pipe.runtime.worker import Worker
from rlinf_pipe.runtime.worker_group import WorkerGroup

T = TypeVar("T")
UNWIND_S = 5.0  # how long a cancelled guarded call may take to unwind


class Health:
    """Pings every worker of `groups()` every `interval_s` while a guarded call runs; a worker that fails its ping
    died, one that does not answer within `timeout_s` hung (see `WorkerGroup.unhealthy`)."""

    def __init__(self, groups: Callable[[], list[WorkerGroup[Worker]]], timeout_s: float):
        self.groups, self.timeout_s = groups, timeout_s
        self.interval_s = max(0.5, min(5.0, timeout_s / 4))
        self.round_trips: list[float] = []  # the answered pings' seconds since `take_round_trip_s`

    async def find_lost(self) -> list[WorkerLost]:
        """The workers that are gone or hung right now."""
        found = await asyncio.gather(*(group.unhealthy(self.timeout_s, self.round_trips) for group in self.groups()))
        return [lost for group_lost in found for lost in group_lost]

    def take_round_trip_s(self) -> float | None:
        """The median seconds of a ping's round trip to a worker since the last call (None: no ping answered), a
        driver call's cost on this cluster under the run's load (the planner's profile reads it)."""
        trips, self.round_trips = sorted(self.round_trips), []
        return trips[len(trips) // 2] if trips else None

    async def _heartbeat(self) -> None:
        while True:
            lost = await self.find_lost()
            if lost:
                raise lost[0]
            await asyncio.sleep(self.interval_s)

    async def guard(self, call: Awaitable[T]) -> T:
        """`call`'s result. A lost worker found by the heartbeat cancels `call` and raises its `WorkerLost`; a
        `WorkerError` of `call` whose cause is a lost worker elsewhere (a stage that noticed its peer was gone)
        is replaced by that worker's `WorkerLost`."""
        task, beat = asyncio.ensure_future(call), asyncio.ensure_future(self._heartbeat())
        try:
            done, _ = await asyncio.wait({task, beat}, return_when=asyncio.FIRST_COMPLETED)
            if task not in done:
                raise beat.exception() or RuntimeError("heartbeat stopped")
            try:
                return task.result()
            except WorkerLost:
                raise
            except WorkerError as exc:
                lost = await self.find_lost()
                if lost:
                    raise lost[0] from exc
                raise
        finally:
            task.cancel()
            beat.cancel()
            if not task.done():  # let the call unwind (its prompt draw, its stage tasks) before whatever follows
                await asyncio.wait({task}, timeout=UNWIND_S)
