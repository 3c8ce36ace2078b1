"""LocalChannel: the in-process channel (collocated mode) with the same semantics as the socket channel."""

from __future__ import annotations

import asyncio
import threading

import pytest

from rlinf_pipe.errors import ChannelClosed, ChannelTimeout
from rlinf_pipe.scheduler.channel import LocalChannel, StepEnd


def test_fifo_with_step_markers_and_end_of_stream():
    ch = LocalChannel("c")
    for i in range(3):
        ch.put(i)
    ch.end_step()
    ch.put(10)
    ch.close()  # ends step 1 because it has an item
    assert [ch.get() for _ in range(6)] == [0, 1, 2, StepEnd(0), 10, StepEnd(1)]
    with pytest.raises(ChannelClosed, match="every producer closed"):
        ch.get()


def test_items_of_the_next_step_wait_for_the_step_end():
    ch = LocalChannel("c", num_producers=2)
    ch.put("a0")
    ch.end_step()  # producer 1 ended step 0; producer 2 has not
    assert ch.get() == "a0"
    with pytest.raises(ChannelTimeout):
        ch.get(timeout=0.05)
    ch.end_step()
    assert ch.get() == StepEnd(0)


def test_put_blocks_at_capacity_and_resumes_after_a_get():
    ch = LocalChannel("c", maxsize=2)
    ch.put(1)
    ch.put(2)
    with pytest.raises(ChannelTimeout, match="put"):
        ch.put(3, timeout=0.05)
    assert ch.get() == 1
    ch.put(3, timeout=1)
    assert ch.qsize() == 2


def test_weighted_capacity_admits_an_oversized_item_only_when_empty():
    ch = LocalChannel("c", maxsize=10)
    ch.put("big", weight=25)  # larger than the capacity: accepted because the channel is empty
    with pytest.raises(ChannelTimeout):
        ch.put("small", weight=1, timeout=0.05)
    assert ch.get() == "big" and ch.weight() == 0


def test_blocked_producer_thread_is_woken_by_the_consumer():
    ch = LocalChannel("c", maxsize=1)
    ch.put(0)
    done = threading.Event()

    def produce():
        ch.put(1)
        done.set()

    thread = threading.Thread(target=produce)
    thread.start()
    assert not done.wait(0.05)  # blocked: the channel is full
    assert ch.get() == 0
    thread.join(timeout=5)
    assert done.is_set() and ch.get() == 1


def test_get_batch_greedy_up_to_the_weight():
    ch = LocalChannel("c")
    for weight in (3, 4, 2, 5):
        ch.put(f"w{weight}", weight=weight)
    ch.end_step()
    assert ch.get_batch(7) == ["w3", "w4"]  # exactly the target
    assert ch.get_batch(6) == ["w2"]  # w5 would overflow: stop before it
    assert ch.get_batch(1) == ["w5"]  # always at least one item, even above the target
    assert ch.get_batch(10) == StepEnd(0)


def test_get_batch_returns_a_partial_batch_at_the_step_end():
    ch = LocalChannel("c")
    ch.put("a", weight=2)
    ch.end_step()
    ch.put("next", weight=1)
    assert ch.get_batch(100) == ["a"]
    assert ch.get_batch(100) == StepEnd(0)
    assert ch.get_batch(1) == ["next"]


def test_timed_out_get_batch_puts_its_items_back():
    ch = LocalChannel("c")
    ch.put("a", weight=1)
    with pytest.raises(ChannelTimeout):
        ch.get_batch(5, timeout=0.05)
    assert ch.qsize() == 1 and ch.get() == "a"


def test_put_after_close_raises():
    ch = LocalChannel("c")
    ch.close()
    with pytest.raises(ChannelClosed, match="after close"):
        ch.put(1)


def test_iter_step_yields_one_step():
    ch = LocalChannel("c")
    for i in range(3):
        ch.put(i)
    ch.end_step()
    ch.put(99)
    assert list(ch.iter_step()) == [0, 1, 2]
    assert ch.get() == 99


async def test_async_put_and_get_with_backpressure():
    ch = LocalChannel("c", maxsize=2)

    async def produce():
        for i in range(20):
            await ch.aput(i)
        ch.close()

    async def consume():
        items = []
        while True:
            try:
                item = await ch.aget(timeout=5)
            except ChannelClosed:
                return items
            items.append(item)

    _, items = await asyncio.gather(produce(), consume())
    assert items == list(range(20)) + [StepEnd(0)]


async def test_async_get_batch():
    ch = LocalChannel("c")
    ch.put("a", weight=2)
    ch.put("b", weight=2)
    ch.end_step()
    assert await ch.aget_batch(4) == ["a", "b"]
    assert await ch.aget_batch(4) == StepEnd(0)


def test_stats_report_buffered_items_and_weight():
    ch = LocalChannel("c")
    ch.put("a", weight=3)
    ch.put("b", weight=4)
    assert ch.stats() == {"buffered_items": 2, "buffered_weight": 7}
    ch.get()
    assert ch.stats() == {"buffered_items": 1, "buffered_weight": 4}
