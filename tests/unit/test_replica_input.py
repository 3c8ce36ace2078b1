"""`read_shared` / `leave_shared` over a replica of two ranks (the broadcast faked by queues between threads, as
`ReplicaRanks.share` runs in a thread): a rank that leaves the step on its own leaves no other rank waiting."""

from __future__ import annotations

import asyncio
import queue
from dataclasses import dataclass, field
from typing import Any

import pytest

from rlinf_pipe.errors import ChannelClosed
from rlinf_pipe.workers.replica_input import ReplicaInputFailed, leave_shared, read_shared


@dataclass
class _Ranks:
    """One rank of a replica whose `share` is the input rank's item, passed through `inbox` queues."""

    is_input: bool
    inboxes: list[queue.Queue] = field(default_factory=list)  # the other ranks' (input) / this rank's (others)
    mp_size: int = 2

    def share(self, item: Any) -> Any:
        if self.is_input:
            for inbox in self.inboxes:
                inbox.put(item)
            return item
        return self.inboxes[0].get(timeout=30)


def _replica() -> tuple[_Ranks, _Ranks]:
    inbox: queue.Queue = queue.Queue()
    return _Ranks(is_input=True, inboxes=[inbox]), _Ranks(is_input=False, inboxes=[inbox])


async def _aborted() -> Any:
    raise ChannelClosed("the channel was aborted (the step is abandoned)")


async def _item() -> Any:
    return "group 7"


async def test_an_input_rank_that_leaves_ends_the_others_next_read():
    """Tensor parallel: the input rank is also the output rank; its put failed, the other rank reads next."""
    first, other = _replica()
    left, read = await asyncio.gather(leave_shared(first, _item, "its output rank failed to put"),
                                      read_shared(other, _item), return_exceptions=True)
    assert left is None and isinstance(read, ReplicaInputFailed) and "failed to put" in str(read)


async def test_an_output_rank_that_leaves_joins_the_input_ranks_failed_read():
    """Pipeline parallel: the output rank (last stage) leaves; the input rank's next read fails on the aborted
    channel and shares that, which the leaving rank takes in instead of being waited for."""
    first, last = _replica()
    read, left = await asyncio.gather(read_shared(first, _aborted), leave_shared(last, _aborted, "unused"),
                                      return_exceptions=True)
    assert isinstance(read, ChannelClosed) and left is None


async def test_a_replica_of_one_rank_leaves_at_once():
    lone = _Ranks(is_input=True, mp_size=1)
    await leave_shared(lone, _aborted, "unused")  # (no share: nothing waits)
    assert await read_shared(lone, _item) == "group 7"
    with pytest.raises(ChannelClosed):
        await read_shared(lone, _aborted)
