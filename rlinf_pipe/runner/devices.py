"""The actor's device phases. With the engines on its GPUs, a phase takes the device locks of the actor's GPUs and
brings its state onto them, and gives both back after: the engines take the same GPUs in between. Otherwise the
actor has its GPUs to itself and a phase does nothing."""

from __future__ import annotations

from collections.abc import AsyncIterator, Callable
from contextlib import AbstractAsyncContextManager, asynccontextmanager
from typing import TYPE_CHECKING

from rlinf_pipe.runtime.worker_group import WorkerGroup

if TYPE_CHECKING:
    from rlinf_pipe.workers.actor import ActorWorker

ActorPhase = Callable[[int], AbstractAsyncContextManager[None]]


def actor_phases(actor: WorkerGroup[ActorWorker], shared: bool) -> ActorPhase:
    """`async with phase(step):` holds the actor's devices for the block (see the module docstring)."""

    from rlinf_pipe.workers.actor import ActorWorker

    @asynccontextmanager
    async def holding_devices(step: int) -> AsyncIterator[None]:
        await actor.all.call(ActorWorker.begin_phase, step)
        yield
        # Not in a `finally`: a phase cut short (a lost worker, a stop) is ended by `ActorWorker.settle_devices`
        # once the actor's calls are over, never while its training may still run.
        await actor.all.call(ActorWorker.end_phase, step)

    @asynccontextmanager
    async def own_devices(step: int) -> AsyncIterator[None]:
        yield

    return holding_devices if shared else own_devices
