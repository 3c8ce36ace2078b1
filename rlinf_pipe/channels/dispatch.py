"""Which of a producing end's queued items go out now, to whom, and how: the credits in a row for one consumer make
one message, and the large buffers of items for a consumer on the producer's node go through its arena, or wait
there for room."""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass
from typing import Any

from rlinf_pipe.channels.arena import SHARED_MIN_BYTES
from rlinf_pipe.channels.links import ConsumerLink, OutItem

BATCH_BYTES = 1024 * 1024  # items waiting for one consumer go in one message up to about this size


@dataclass
class Message:
    """Items for one consumer, ready to send: their metas (see `wire.ITEM`) and the frames of their buffers that
    travel on the socket."""

    cid: bytes
    items: list[OutItem]
    metas: list[Any]
    frames: list[Any]


def next_message(queue: deque[OutItem], credits: deque[bytes], consumers: dict[bytes, ConsumerLink],
                 waiting: list[bytes]) -> Message | None:
    """Take the next message off the front of `queue` and `credits`, in order; None when no credit can be used now.

    The items that the next credits in a row give to the same consumer go in one message (up to `BATCH_BYTES`): a
    producer ahead of its consumers sends fewer, larger messages, and each end wakes once for several items. A
    consumer on this node for whose next item the arena has no room waits, keeping its credit (put in `waiting`,
    for the caller to return to the front of `credits`), while items it will take first hold regions (`may_wait`):
    its reports free room soon, and sending it the rest over the socket, dearer for both ends, would put it further
    behind. Otherwise the item goes over the socket (its app may hold every region until more arrives)."""
    while queue and credits:
        cid = credits.popleft()
        link = consumers.get(cid)
        if link is None or link.dead:
            continue
        if waiting and cid in waiting:
            waiting.append(cid)
            continue
        batch = [queue.popleft()]
        size = batch[0].nbytes
        while queue and credits and credits[0] == cid and size < BATCH_BYTES:
            credits.popleft()
            batch.append(queue.popleft())
            size += batch[-1].nbytes
        if link.arena is None or size < SHARED_MIN_BYTES:
            metas = [[item.seq, item.step, item.weight, item.header, len(item.buffers)] for item in batch]
            return Message(cid, batch, metas, [buffer for item in batch for buffer in item.buffers])
        metas, frames = place(link, batch)  # (some buffer may go through the arena)
        if len(metas) < len(batch):  # the rest waits for room, back at the front, with its credits
            unsent = batch[len(metas):]
            del batch[len(metas):]
            queue.extendleft(reversed(unsent))
            waiting.extend([cid] * len(unsent))
        if batch:
            return Message(cid, batch, metas, frames)
    return None


def place(link: ConsumerLink, batch: list[OutItem]) -> tuple[list[Any], list[Any]]:
    """The metas and frames of the batch's items that go now (a prefix of the batch): an item whose large buffers
    find no room in the arena stops it where it may wait (`may_wait`), else goes over the socket."""
    metas: list[Any] = []
    frames: list[Any] = []
    placed_any = False  # an earlier item of this batch holds regions
    for item in batch:
        placed, sent_frames, missed = link.place(item)
        if missed and may_wait(link, item, missed, placed_any):  # (an item that missed holds no region)
            break
        placed_any = placed_any or bool(item.regions)
        if missed:
            link.arena.note_overflow(missed)
        metas.append([item.seq, item.step, item.weight, item.header, placed])
        frames.extend(sent_frames)
    return metas, frames


def may_wait(link: ConsumerLink, item: OutItem, large_bytes: int, placed_any: bool) -> bool:
    """Whether an item that finds no room may wait for `link`'s consumer to free some: only if it can ever fit, and
    regions are held by items that consumer will take before it (this batch's, or sent and untaken ones of its
    step or an earlier one: a consumer takes no item of a later step before this one's ends)."""
    if large_bytes > link.arena.allocator.size:
        return False
    return placed_any or any(
        held.regions and not held.taken and held.step <= item.step for held in link.inflight.values()
    )
