"""`Channel`: a named, typed stream between processes (pyzmq + msgspec).

    rollouts = Channel.create("rollouts", RolloutGroup, maxsize=16, num_producers=4)   # once, e.g. the driver
    rollouts = Channel.open("rollouts", RolloutGroup)                                # anywhere else
    rollouts.put(group, weight=len(group.samples)); rollouts.end_step(); rollouts.close()   # producers
    for group in rollouts.iter_step(): ...; item = await rollouts.aget()            # consumers

A process gets its producing end on its first put and its consuming end on its first get. Handles pickle by name,
so a Channel can be passed to Ray workers.
"""

from __future__ import annotations

import threading
from collections.abc import Iterator
from typing import Any, Generic, TypeVar

import msgspec
import ray

from rlinf_pipe.errors import ChannelClosed, ChannelError
from rlinf_pipe.channels.buffer import StepBuffer, StepEnd, Waiter
from rlinf_pipe.channels.codec import Codec
from rlinf_pipe.channels.consumer import ConsumerEnd
from rlinf_pipe.channels.producer import ProducerEnd
from rlinf_pipe.channels.registry import ChannelSpec, registry

T = TypeVar("T")


_HANDLES: dict[tuple[str, Any], "Channel"] = {}
_HANDLES_LOCK = threading.Lock()


def _process_handle(spec: ChannelSpec, item_type: Any) -> "Channel":
    """The one handle of this process on a channel (unpickling reuses it), so a worker that receives the channel
    in every call keeps a single producing and a single consuming end (its step count and credit live there)."""
    with _HANDLES_LOCK:
        handle = _HANDLES.get((spec.name, item_type))
        if handle is None or handle.spec != spec or handle._closed:
            handle = _HANDLES[(spec.name, item_type)] = Channel(spec, item_type)
        return handle


def abort_process_handles() -> int:
    """Abort every channel handle this process received (a worker abandoning a step: whatever waits on one of them
    raises `ChannelClosed` at once); returns how many. Handles received afterwards are new ones."""
    with _HANDLES_LOCK:
        handles = list(_HANDLES.values())
        _HANDLES.clear()
    for handle in handles:
        handle.abort()
    return len(handles)


class Channel(Generic[T]):
    """A handle on a named socket channel; see the module docstring."""

    def __init__(self, spec: ChannelSpec, item_type: Any = Any):
        self.spec, self.name, self.item_type = spec, spec.name, item_type
        self.codec = Codec(item_type)
        self._lock = threading.Lock()
        self._producer: ProducerEnd | None = None
        self._consumer_end: ConsumerEnd | None = None
        self._closed = False

    @classmethod
    def create(cls, name: str, item_type: Any = Any, **spec: Any) -> "Channel[T]":
        """Declare the channel (idempotent when the spec matches) and return a handle."""
        wanted = ChannelSpec(name=name, **spec)
        existing = ray.get(registry().declare.remote(wanted))
        if msgspec.structs.replace(existing, key=wanted.key) != wanted:  # (the key is the registry's)
            raise ChannelError(f"channel {name!r} already exists with a different spec: {existing} (asked {wanted})")
        return cls(existing, item_type)

    @classmethod
    def open(cls, name: str, item_type: Any = Any) -> "Channel[T]":
        """A handle on an existing channel."""
        spec = ray.get(registry().spec.remote(name))
        if spec is None:
            raise ChannelError(f"channel {name!r} does not exist; create it first with Channel.create({name!r}, ...)")
        return cls(spec, item_type)

    def __reduce__(self):
        return (_process_handle, (self.spec, self.item_type))

    # --- producer -------------------------------------------------------------------------------------------
    def _producer_end(self) -> ProducerEnd:
        end = self._producer
        if end is not None and not self._closed:  # (the hot path: no lock once the end exists)
            return end
        with self._lock:
            if self._closed:
                raise ChannelClosed(f"channel {self.name!r}: used after close()")
            if self._producer is None:
                self._producer = ProducerEnd(self.spec, self.codec)
            return self._producer

    def put(self, item: T, weight: float = 1, timeout: float | None = None) -> None:
        """Send `item`. Blocks while this producer has `maxsize` weight of items no consumer has taken yet."""
        end = self._producer_end()
        frames = self.codec.encode(item)
        end._waiter.wait(lambda: end.try_put(frames, weight), timeout, f"channel {self.name!r} put")

    async def aput(self, item: T, weight: float = 1, timeout: float | None = None) -> None:
        end = self._producer_end()
        frames = self.codec.encode(item)
        await end._waiter.await_(lambda: end.try_put(frames, weight), timeout, f"channel {self.name!r} put")

    def end_step(self) -> None:
        """This producer has put every item of the current step (a step ends once every producer ended it)."""
        self._producer_end().end_step()

    # --- consumer -------------------------------------------------------------------------------------------
    def _consumer(self) -> tuple[Waiter, StepBuffer]:
        end = self._consumer_end
        if end is not None and not self._closed:  # (the hot path: no lock once the end exists)
            return end._waiter, end.buffer
        with self._lock:
            if self._closed:
                raise ChannelClosed(f"channel {self.name!r}: used after close()")
            if self._consumer_end is None:
                self._consumer_end = ConsumerEnd(self.spec)
            return self._consumer_end._waiter, self._consumer_end.buffer

    def _try_take(self) -> Any:
        end = self._consumer_end
        end.check()
        entry = end.take()  # (handed over at once: credit and acknowledgement together)
        return entry if entry is not None else end.buffer.next_marker()

    def get(self, timeout: float | None = None) -> T | StepEnd:
        """The next item of the current step, or `StepEnd(step)` once all of the step's items are delivered.
        Raises ChannelClosed after every producer closed and everything was delivered."""
        waiter, _ = self._consumer()
        result = waiter.wait(self._try_take, timeout, f"channel {self.name!r} get")
        return result if isinstance(result, StepEnd) else self.codec.decode(result.payload)

    async def aget(self, timeout: float | None = None) -> T | StepEnd:
        """`get()` for asyncio code."""
        waiter, _ = self._consumer()
        result = await waiter.await_(self._try_take, timeout, f"channel {self.name!r} get")
        return result if isinstance(result, StepEnd) else self.codec.decode(result.payload)

    def iter_step(self, timeout: float | None = None) -> Iterator[T]:
        """Yield the current step's items; stops after its StepEnd, or at the end of the stream (every producer
        closed). Any other ChannelClosed (this handle closed or aborted, Ray gone) is raised."""
        while True:
            try:
                item = self.get(timeout)
            except ChannelClosed:
                if self._consumer_end is not None and self._consumer_end.buffer.stream_ended():
                    return
                raise
            if isinstance(item, StepEnd):
                return
            yield item

    def qsize(self) -> int:
        """Items buffered at this consumer and not yet taken."""
        waiter, buffer = self._consumer()
        with waiter.lock:
            self._consumer_end.receive()
            return buffer.count

    # --- lifetime -------------------------------------------------------------------------------------------
    def _mark_closed(self) -> bool:
        """Close the handle once; False if it already was."""
        with self._lock:
            if self._closed:
                return False
            self._closed = True
            return True

    def _draining_producer(self) -> ProducerEnd | None:
        if self._producer is not None:
            self._producer.begin_close()
        return self._producer

    def _stop_ends(self, confirm: bool = False) -> None:
        """Stop this process's ends; with `confirm`, the consuming end waits until its producers heard it leave."""
        if self._consumer_end is not None:
            self._consumer_end.stop(confirm)
        if self._producer is not None:
            self._producer.stop()

    def close(self, timeout: float | None = None) -> None:
        """Producer end: end the current step if it has items, wait until every item was taken by a consumer,
        then tell consumers this producer is done. Consumer end: leave (untaken items go to other consumers).
        Any use of this handle afterwards raises ChannelClosed."""
        if not self._mark_closed():
            return
        try:
            if (producer := self._draining_producer()) is not None:
                producer._waiter.wait(producer.try_finish_close, timeout, f"channel {self.name!r} close")
        finally:
            self._stop_ends(confirm=True)

    async def aclose(self, timeout: float | None = None) -> None:
        """`close()` for asyncio code: the producer's drain is awaited instead of blocking the loop."""
        if not self._mark_closed():
            return
        try:
            if (producer := self._draining_producer()) is not None:
                await producer._waiter.await_(producer.try_finish_close, timeout, f"channel {self.name!r} close")
        finally:
            self._stop_ends(confirm=True)  # (a few milliseconds: the producers answer at once)

    def abort(self) -> None:
        """Tear this process's ends down at once, without draining (error paths, teardown). Items this producer
        still holds are lost; a consumer's untaken items go back to their producers."""
        self._mark_closed()
        self._stop_ends()

    def stats(self) -> dict[str, float]:
        """Queue sizes at this process's ends (for metrics)."""
        out: dict[str, float] = {}
        if self._producer is not None:
            out["untaken_items"], out["untaken_weight"] = self._producer.untaken()
            out["shared_bytes_used"], out["shared_bytes_overflow"] = self._producer.shared_memory()
        if self._consumer_end is not None:
            with self._consumer_end._waiter.lock:
                self._consumer_end.receive()
                out["buffered_items"] = self._consumer_end.buffer.count
                out["buffered_weight"] = self._consumer_end.buffer.weight
        return out
