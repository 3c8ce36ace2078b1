"""`StageCalls`: the stage calls a step runs at once, failing together.

Waiting on some of them fails fast when ANY of them fails, and cancels the others: a failed stage would otherwise
leave the rest blocked on their channels.
"""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable
from typing import Any, TypeVar

from rlinf_pipe.utils.futures import mark_retrieved

T = TypeVar("T")


class StageCalls:
    """The step's running stage calls (see the module docstring)."""

    def __init__(self) -> None:
        self.tasks: dict[str, asyncio.Future[Any]] = {}
        self.watched: dict[str, asyncio.Future[Any]] = {}  # calls that run on into the next step

    def start(self, name: str, call: Awaitable[T]) -> asyncio.Future[T]:
        """Start a call of this step."""
        task = asyncio.ensure_future(call)
        self.tasks[name] = task
        return task

    def watch(self, name: str, call: Awaitable[T]) -> asyncio.Future[T]:
        """Start a call that runs on into the next step: its failure fails this step, but `until_all` leaves it
        out (the next step adopts it, and fails with it). Dropped when a lost worker ends the run's steps before
        that, it logs nothing."""
        task = asyncio.ensure_future(call)
        task.add_done_callback(mark_retrieved)
        key, n = name, 1
        while key in self.watched:  # (several steps started ahead in one step)
            key, n = f"{name}_{n}", n + 1
        self.watched[key] = task
        return task

    def adopt(self, name: str, task: asyncio.Future) -> asyncio.Future:
        """Count a call started in an earlier step (`watch`) as one of this step's."""
        self.tasks[name] = task
        return task

    async def until(self, *targets: asyncio.Future) -> None:
        """Wait for `targets`; the first failure of any call of the step cancels the others and raises."""
        pending = set(targets)
        while pending:
            running = [*self.tasks.values(), *self.watched.values()]
            watch = pending | {t for t in running if not t.done()}
            try:
                done, _ = await asyncio.wait(watch, return_when=asyncio.FIRST_COMPLETED)
            except asyncio.CancelledError:  # the step is abandoned (a lost worker, a stop): so are its calls
                self.cancel()
                raise
            for task in done:
                if not task.cancelled() and (failure := task.exception()) is not None:
                    self.cancel()
                    raise failure
            pending -= done

    def cancel(self) -> None:
        """Cancel every call of the step. Their failures count as seen: the one that failed the step was raised,
        the others (several stages fail together when a worker is lost) would each log "exception was never
        retrieved" with its traceback once collected, long after the loss was handled."""
        for task in [*self.tasks.values(), *self.watched.values()]:
            if task.done():
                mark_retrieved(task)
            else:
                task.add_done_callback(mark_retrieved)
                task.cancel()

    async def until_all(self) -> None:
        """Wait for every call of this step (not the watched ones)."""
        await self.until(*self.tasks.values())
