"""A model replica's input, read on its input rank and shared with its other ranks, such that a failed read ends
the step on every rank of the replica: the input rank shares the failure instead of an item (a channel aborted
when the step was abandoned, a bad item), so no rank is left waiting in the share for an item that never comes."""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from typing import Any, TypeVar

from rlinf_pipe.engines.policy import ReplicaRanks
from rlinf_pipe.errors import RlinfPipeError

T = TypeVar("T")


class ReplicaInputFailed(RlinfPipeError):
    """The replica's input rank could not read its input; this rank ends the step as well."""


@dataclass(frozen=True)
class _Failed:
    reason: str


async def read_shared(ranks: ReplicaRanks, read: Callable[[], Awaitable[T]]) -> T:
    """`await read()` on the input rank, its result on every rank of the replica (collective over the replica).
    A failure of `read` raises there and `ReplicaInputFailed` on the other ranks."""
    item: Any = None
    if ranks.is_input:
        try:
            item = await read()
        except Exception as exc:
            if ranks.mp_size > 1:
                await asyncio.to_thread(ranks.share, _Failed(f"{type(exc).__name__}: {exc}"))
            raise
    if ranks.mp_size > 1:
        item = await asyncio.to_thread(ranks.share, item)
    if isinstance(item, _Failed):
        raise ReplicaInputFailed(f"the replica's input rank failed to read: {item.reason}")
    return item


async def leave_shared(ranks: ReplicaRanks, read: Callable[[], Awaitable[Any]], reason: str) -> None:
    """This rank leaves the step on its own (its output failed: a channel aborted when the step was abandoned) while
    the replica's other ranks go on to the next `read_shared`: take part in that read once more, so none of them is
    left waiting in the share. The input rank shares the failure; another rank (the output rank of a pipeline) joins
    the read, whose channel is aborted too, so the input rank shares the failure itself."""
    if ranks.mp_size == 1:
        return
    if ranks.is_input:
        await asyncio.to_thread(ranks.share, _Failed(reason))
        return
    try:
        await read_shared(ranks, read)
    except ReplicaInputFailed:
        pass
