"""Consumer-side state shared by every channel kind: a step-aware FIFO, and waiting from threads or asyncio.

A consumer sees a step's items, then `StepEnd(step)`, then the next step's items. A step ends for a consumer when
every producer has ended it (and, for socket channels, every item of it has been taken by some consumer).
"""

from __future__ import annotations

import asyncio
import threading
import time
from collections import deque
from dataclasses import dataclass, field
from typing import Any, Callable, TypeVar

import msgspec

from rlinf_pipe.errors import ChannelClosed, ChannelPeerError, ChannelTimeout

T = TypeVar("T")
PENDING: Any = object()  # "not yet": the blocking wrappers wait and try again
RECHECK_S = 0.25  # waiters re-check at least this often (time-based failures such as peer timeouts)


class StepEnd(msgspec.Struct, frozen=True):
    """Returned by `get()` once every item of `step` has been delivered."""

    step: int


@dataclass(slots=True)
class Entry:
    """One item in a consumer's buffer. `payload` is the item (local) or its frames (socket)."""

    producer: str
    seq: int
    step: int
    weight: float
    payload: Any


@dataclass
class ProducerState:
    """What a consumer knows of one producer. Closing ends the producer's last step if it had items."""

    ended_through: int = -1  # every step <= this has ended for this producer
    closed: bool = False
    dead: str | None = None  # why it is considered dead

    @property
    def gone(self) -> bool:
        """Closed or dead: it reads nothing more."""
        return self.closed or self.dead is not None


@dataclass
class StepBuffer:
    """Items received by one consumer, with the step and end-of-stream bookkeeping."""

    channel: str
    expected_producers: int | None = None
    by_step: dict[int, deque[Entry]] = field(default_factory=dict)
    producers: dict[str, ProducerState] = field(default_factory=dict)
    step: int = 0
    count: int = 0
    weight: float = 0.0

    def producer(self, name: str) -> ProducerState:
        return self.producers.setdefault(name, ProducerState())

    def add(self, entry: Entry) -> None:
        self.producer(entry.producer)
        self.by_step.setdefault(entry.step, deque()).append(entry)
        self.count += 1
        self.weight += entry.weight

    def _current_queue(self) -> deque[Entry] | None:
        queue = self.by_step.get(self.step)
        if queue and len(self.by_step) == 1:  # the common case: items of the current step only
            return queue
        for step in sorted(s for s in self.by_step if s <= self.step):
            if self.by_step[step]:
                return self.by_step[step]
            del self.by_step[step]
        return None

    def peek(self) -> Entry | None:
        """The oldest buffered entry of the current step (or an older one), if any."""
        queue = self._current_queue()
        return queue[0] if queue else None

    def pop(self) -> Entry | None:
        """Take out the entry `peek` would return, if any."""
        queue = self._current_queue()
        if not queue:
            return None
        entry = queue.popleft()
        self.count -= 1
        self.weight -= entry.weight
        return entry

    def _all_producers_known(self) -> bool:
        if self.expected_producers is None:
            return bool(self.producers)
        return len(self.producers) >= self.expected_producers

    def step_complete(self) -> bool:
        return (
            self._all_producers_known()
            and all(p.ended_through >= self.step for p in self.producers.values())
            and self.peek() is None
        )

    def stream_ended(self) -> bool:
        return (
            self._all_producers_known()
            and all(p.closed and p.ended_through < self.step for p in self.producers.values())
            and not self.count
        )

    def check_peers(self) -> None:
        """Raise if the current step waits on a producer that is dead."""
        for name, state in self.producers.items():
            if state.dead and not state.closed and state.ended_through < self.step:
                raise ChannelPeerError(
                    f"channel {self.channel!r}: producer {name} {state.dead}; step {self.step} cannot complete"
                )

    def next_marker(self) -> Any:
        """StepEnd (advancing the step), a ChannelClosed raise, a peer error, or PENDING."""
        if self.step_complete():
            self.step += 1
            return StepEnd(self.step - 1)
        if self.stream_ended():
            raise ChannelClosed(f"channel {self.channel!r}: every producer closed and all items were delivered")
        self.check_peers()
        return PENDING


class Waiter:
    """Lets threads (`wait`) and asyncio tasks (`await_`) block until an attempt under `lock` succeeds."""

    def __init__(self, lock: threading.RLock):
        self.lock = lock
        self._condition = threading.Condition(lock)
        self._futures: list[tuple[asyncio.AbstractEventLoop, asyncio.Future]] = []

    def notify(self) -> None:
        """Wake every waiter (call with the lock held)."""
        self._condition.notify_all()
        futures, self._futures = self._futures, []
        for loop, future in futures:
            try:
                loop.call_soon_threadsafe(_resolve, future)
            except RuntimeError:  # its loop is closed (the run ended): nobody waits there any more
                pass

    def wait(self, attempt: Callable[[], T], timeout: float | None, what: str) -> T:
        deadline = None if timeout is None else time.monotonic() + timeout
        with self.lock:
            while True:
                result = attempt()
                if result is not PENDING:
                    return result
                left = RECHECK_S if deadline is None else deadline - time.monotonic()
                if left <= 0:
                    raise ChannelTimeout(f"{what}: no progress within {timeout:g} s")
                self._condition.wait(min(left, RECHECK_S))

    async def await_(self, attempt: Callable[[], T], timeout: float | None, what: str) -> T:
        loop = asyncio.get_running_loop()
        deadline = None if timeout is None else time.monotonic() + timeout
        while True:
            with self.lock:
                result = attempt()
                if result is not PENDING:
                    return result
                future = loop.create_future()
                self._futures.append((loop, future))
            left = RECHECK_S if deadline is None else deadline - time.monotonic()
            if left <= 0:
                raise ChannelTimeout(f"{what}: no progress within {timeout:g} s")
            await self._sleep(loop, future, min(left, RECHECK_S))

    async def _sleep(self, loop: asyncio.AbstractEventLoop, future: asyncio.Future, seconds: float) -> None:
        """Until `future` is resolved (by `notify`) or `seconds` passed."""
        timer = loop.call_later(seconds, _resolve, future)  # (lighter than asyncio.wait_for)
        try:
            await future
        finally:
            timer.cancel()


def _resolve(future: asyncio.Future) -> None:
    if not future.done():
        future.set_result(None)
