"""The consumer calls shared by every channel kind: get / get_batch, blocking and async.

A channel kind supplies `_consumer()` (its Waiter and StepBuffer), `_try_take()` (under the lock: the next Entry,
already acknowledged, or a StepEnd, or PENDING), `_on_take(entries)` (entries left the buffer for a batch),
`_ack(entries)` (a batch was handed over) and `_decode(entries)` (entries -> items).
"""

from __future__ import annotations

from contextlib import contextmanager
from typing import Any, Generic, Iterator, TypeVar

from rlinf_pipe.errors import ChannelClosed
from rlinf_pipe.scheduler.channel.buffer import (
    BatchAssembler,
    Entry,
    StepBuffer,
    StepEnd,
    Waiter,
)

T = TypeVar("T")


class ConsumerAPI(Generic[T]):
    name: str

    def _consumer(self) -> tuple[Waiter, StepBuffer]:
        raise NotImplementedError

    def _try_take(self) -> Any:
        raise NotImplementedError

    def _on_take(self, entries: list[Entry]) -> None:
        raise NotImplementedError

    def _ack(self, entries: list[Entry]) -> None:
        raise NotImplementedError

    def _decode(self, entries: list[Entry]) -> list[T]:
        raise NotImplementedError

    def _deliver_batch(self, entries: list[Entry]) -> list[T]:
        waiter, _ = self._consumer()
        with waiter.lock:
            self._ack(entries)
        return self._decode(entries)

    def get(self, timeout: float | None = None) -> T | StepEnd:
        """The next item of the current step, or `StepEnd(step)` once all of the step's items are delivered.
        Raises ChannelClosed after every producer closed and everything was delivered."""
        waiter, _ = self._consumer()
        result = waiter.wait(self._try_take, timeout, f"channel {self.name!r} get")
        return result if isinstance(result, StepEnd) else self._decode([result])[0]

    async def aget(self, timeout: float | None = None) -> T | StepEnd:
        waiter, _ = self._consumer()
        result = await waiter.await_(self._try_take, timeout, f"channel {self.name!r} get")
        return result if isinstance(result, StepEnd) else self._decode([result])[0]

    def get_batch(self, target_weight: float, timeout: float | None = None) -> list[T] | StepEnd:
        """Items of the current step, greedily up to `target_weight` (always at least one): waits until the target
        is reached, the next item would not fit, or the step ends. `StepEnd` when the step had nothing left."""
        waiter, assembler = self._assembler(target_weight)
        with self._giving_back(waiter, assembler):
            result = waiter.wait(assembler.attempt, timeout, f"channel {self.name!r} get_batch")
        return result if isinstance(result, StepEnd) else self._deliver_batch(result)

    async def aget_batch(self, target_weight: float, timeout: float | None = None) -> list[T] | StepEnd:
        waiter, assembler = self._assembler(target_weight)
        with self._giving_back(waiter, assembler):
            result = await waiter.await_(assembler.attempt, timeout, f"channel {self.name!r} get_batch")
        return result if isinstance(result, StepEnd) else self._deliver_batch(result)

    def _assembler(self, target_weight: float) -> tuple[Waiter, BatchAssembler]:
        waiter, buffer = self._consumer()
        return waiter, BatchAssembler(buffer, target_weight, self._on_take)

    @staticmethod
    @contextmanager
    def _giving_back(waiter: Waiter, assembler: BatchAssembler) -> Iterator[None]:
        """A get_batch that fails or times out returns its partial batch to the front of the buffer."""
        try:
            yield
        except BaseException:
            with waiter.lock:
                assembler.give_back()
            raise

    def iter_step(self, timeout: float | None = None) -> Iterator[T]:
        """Yield the current step's items; stops after its StepEnd (or at the end of the stream)."""
        while True:
            try:
                item = self.get(timeout)
            except ChannelClosed:
                return
            if isinstance(item, StepEnd):
                return
            yield item

    def qsize(self) -> int:
        """Items buffered at this consumer and not yet taken."""
        waiter, buffer = self._consumer()
        with waiter.lock:
            return buffer.count
