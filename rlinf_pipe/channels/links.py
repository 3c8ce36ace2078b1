"""What a producing end knows of the items it put and of each consumer it serves: the items a consumer was sent and
has not acknowledged, and the regions of the producer's arena (`arena.py`) that the consumer holds."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Iterable, Sequence

from rlinf_pipe.channels.arena import SHARED_MIN_BYTES, SharedArena, process_start


@dataclass
class OutItem:
    """An item put, from its put until a consumer reports it taken and delivered."""

    seq: int
    step: int
    weight: float
    header: bytes  # the item's msgpack (sent in the message's metas)
    buffers: list[Any]  # its tensors' and arrays' bytes (a frame each)
    nbytes: int
    taken: bool = False  # taken out of a consumer's buffer (delivery may still be pending)
    regions: Sequence[int] = ()  # arena offsets of its buffers, as sent to its consumer


@dataclass
class ConsumerLink:
    """One consumer as its producer sees it."""

    last_seen: float
    inflight: dict[int, OutItem] = field(default_factory=dict)  # sent, not yet reported delivered
    dead: str | None = None  # why it was given up
    arena: SharedArena | None = None  # the producer's arena, if this consumer mapped it
    reader: tuple[int, int] | None = None  # pid and start of the process that mapped it (`arena.process_start`)
    held: set[int] = field(default_factory=set)  # arena offsets it holds (not released)

    def place(self, item: OutItem) -> tuple[int | list[Any], Sequence[Any], int]:
        """How an item's buffers travel to this consumer: (frame count, frames), or, where it mapped the arena and
        large buffers found room there, (a place per buffer, frames): see `SharedArena.place`; and the bytes of
        large buffers that found no room."""
        if self.arena is None or item.nbytes < SHARED_MIN_BYTES:
            return len(item.buffers), item.buffers, 0
        places, frames, item.regions, missed = self.arena.place(item.buffers)
        if not item.regions:  # (all small, or the arena is full)
            return len(item.buffers), item.buffers, missed
        self.held.update(item.regions)
        return places, frames, missed

    def release(self, offsets: Iterable[int]) -> None:
        """Free the regions this consumer gave back (offsets it does not hold are ignored)."""
        for offset in offsets:
            if offset in self.held:
                self.held.discard(offset)
                self.arena.free(offset)

    def forget_regions(self, item: OutItem, free: bool) -> None:
        """The item leaves this consumer (to be sent again or not at all): its regions are freed, or (`free`
        False) left to the consumer for good."""
        if free:
            self.release(item.regions)
        item.regions = ()

    def free_if_gone(self) -> int:
        """Free every region this consumer holds if the process that mapped the arena has exited (its mapping went
        with it: nothing reads them any more); the bytes freed."""
        if not self.held or self.reader is None or process_start(self.reader[0]) == self.reader[1]:
            return 0
        used = self.arena.allocator.used_bytes
        self.release(list(self.held))
        return used - self.arena.allocator.used_bytes
