"""`LocalChannel`: the channel API inside one process (collocated mode). No sockets, no serialization: items are
passed by reference. Same step, capacity and close semantics as the socket channel."""

from __future__ import annotations

import threading
from typing import Any, Generic, TypeVar

from rlinf_pipe.errors import ChannelClosed
from rlinf_pipe.scheduler.channel.api import ConsumerAPI
from rlinf_pipe.scheduler.channel.buffer import PENDING, Entry, StepBuffer, Waiter

T = TypeVar("T")
LOCAL = "local"


class LocalChannel(ConsumerAPI[T], Generic[T]):
    """In-process channel. `maxsize` bounds the buffered weight (None: unbounded); `num_producers` producers
    must each call `end_step()` for a step to end (all of them share the producer-side step counter)."""

    def __init__(self, name: str, maxsize: float | None = 1024, num_producers: int = 1):
        self.name, self.maxsize, self.num_producers = name, maxsize, num_producers
        self._waiter = Waiter(threading.RLock())
        self._buffer = StepBuffer(name, expected_producers=1)
        self._buffer.producer(LOCAL)
        self._put_step = 0
        self._ends_of_step = 0
        self._closes = 0
        self._seq = 0
        self._step_has_items = False

    # --- producer -------------------------------------------------------------------------------------------
    def _try_put(self, item: T, weight: float) -> Any:
        if self._closes:
            raise ChannelClosed(f"channel {self.name!r}: put() after close()")
        buffered = self._buffer.weight
        if self.maxsize is not None and buffered and buffered + weight > self.maxsize:
            return PENDING
        self._seq += 1
        self._buffer.add(Entry(LOCAL, self._seq, self._put_step, weight, item))
        self._step_has_items = True
        self._waiter.notify()
        return None

    def put(self, item: T, weight: float = 1, timeout: float | None = None) -> None:
        """Append `item`; blocks while the buffer holds `maxsize` weight."""
        self._waiter.wait(lambda: self._try_put(item, weight), timeout, f"channel {self.name!r} put")

    async def aput(self, item: T, weight: float = 1, timeout: float | None = None) -> None:
        await self._waiter.await_(lambda: self._try_put(item, weight), timeout, f"channel {self.name!r} put")

    def end_step(self) -> None:
        """This producer has put every item of the current step."""
        with self._waiter.lock:
            self._ends_of_step += 1
            if self._ends_of_step == self.num_producers:
                self._end_put_step()

    def _end_put_step(self) -> None:
        self._buffer.producer(LOCAL).ended_through = self._put_step
        self._put_step += 1
        self._ends_of_step = 0
        self._step_has_items = False
        self._waiter.notify()

    def close(self, timeout: float | None = None) -> None:
        """No more puts from this producer; consumers drain what is buffered, then get() raises ChannelClosed.
        (`timeout` exists for API parity with `Channel.close`: nothing here waits.)"""
        with self._waiter.lock:
            self._closes += 1
            if self._closes >= self.num_producers:
                if self._step_has_items:
                    self._end_put_step()
                self._buffer.producer(LOCAL).closed = True
                self._waiter.notify()

    # --- consumer (get / get_batch / async forms come from ConsumerAPI) ---------------------------------------
    def _consumer(self) -> tuple[Waiter, StepBuffer]:
        return self._waiter, self._buffer

    def _try_take(self) -> Any:
        if self._buffer.peek() is not None:
            entry = self._buffer.pop()
            self._waiter.notify()  # capacity freed
            return entry
        return self._buffer.next_marker()

    def _on_take(self, entries: list[Entry]) -> None:
        self._waiter.notify()

    def _ack(self, entries: list[Entry]) -> None:
        pass  # nothing to acknowledge in one process

    def _decode(self, entries: list[Entry]) -> list[T]:
        return [e.payload for e in entries]

    async def aclose(self, timeout: float | None = None) -> None:
        self.close(timeout)

    def abort(self) -> None:
        """Same as close() in one process (nothing to tear down)."""
        self.close()

    # --- introspection --------------------------------------------------------------------------------------
    def weight(self) -> float:
        with self._waiter.lock:
            return self._buffer.weight

    def stats(self) -> dict[str, float]:
        """Queue sizes (for metrics), under the same keys as `Channel.stats`."""
        with self._waiter.lock:
            return {"buffered_items": self._buffer.count, "buffered_weight": self._buffer.weight}
