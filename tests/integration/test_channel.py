"""Socket channels between real processes on a two-node Ray cluster (one machine): ipc on a node, tcp across."""

from __future__ import annotations

import asyncio
import concurrent.futures
import os
import sys
import tempfile
import threading
import time
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import numpy as np
import pytest
import ray
import torch
from support.channel_cluster import nodes_fixture, on_node
from support.channel_items import Rich, assert_same, rich
from support.faults import wait_for
from support.light_items import Tagged

from rlinf_pipe.errors import ChannelClosed, ChannelError, ChannelPeerError, ChannelTimeout
from rlinf_pipe.channels import Channel, StepEnd, wire
from rlinf_pipe.channels.links import ConsumerLink, OutItem
from rlinf_pipe.channels.producer import DIRECT_BYTES

ray.cloudpickle.register_pickle_by_value(sys.modules[__name__])
FAST_FAILURE = {"heartbeat_s": 0.2, "peer_timeout_s": 3.0}  # (a live peer is never 3 s silent, on any load)


@ray.remote(num_cpus=0)
class Producer:
    def __init__(self, channel: Channel, producer: int = 0):
        self.channel, self.producer = channel, producer

    def put_tagged(self, count: int, steps: int = 1, close: bool = True) -> int:
        for step in range(steps):
            for seq in range(count):
                self.channel.put(Tagged(self.producer, seq, step))
            self.channel.end_step()
        if close:
            self.channel.close()
        return count * steps

    def put_until_blocked(self, limit: int, timeout: float) -> int:
        """Put items until a put times out; returns how many went in."""
        for n in range(limit):
            try:
                self.channel.put(Tagged(self.producer, n), timeout=timeout)
            except ChannelTimeout:
                return n
        return limit

    def put_rich(self, count: int) -> None:
        from support.channel_items import rich  # (torch: only in the processes that put rich items)

        for step in range(count):
            self.channel.put(rich(step))
        self.channel.close()

    def node_id(self) -> str:
        return ray.get_runtime_context().get_node_id()

    def untaken(self) -> float:
        return self.channel.stats()["untaken_items"]

    def put_step(self, seqs: list[int]) -> None:
        for seq in seqs:
            self.channel.put(Tagged(self.producer, seq))
        self.channel.end_step()

    def open(self) -> None:
        self.channel._producer_end()  # (this process's producing end, before any put)

    def consumers(self) -> int:
        return len(self.channel._producer._consumers)

    def abort_handles(self) -> int:
        from rlinf_pipe.channels.channel import abort_process_handles

        return abort_process_handles()

    def given_up(self) -> list[str]:
        """Why this producer gave up each consumer it gave up."""
        return [link.dead for link in self.channel._producer._consumers.values() if link.dead]

    def refused(self) -> list[str]:
        """The peers its socket refused (each once)."""
        return list(self.channel._producer._door.refused)

    def tcp_bound(self) -> str:
        """The tcp address its socket listens on (bound last)."""
        import zmq

        return self.channel._producer._router.getsockopt_string(zmq.LAST_ENDPOINT)


@ray.remote(num_cpus=0)
class Consumer:
    def __init__(self, channel: Channel, delay_s: float = 0.0, slow_every: int = 1):
        self.channel, self.delay_s, self.slow_every = channel, delay_s, slow_every

    def drain(self) -> list[tuple[int, int, int]]:
        """Take items until the stream ends (a pause of `delay_s` every `slow_every` items simulates a slow
        consumer's work)."""
        seen = []
        while True:
            try:
                item = self.channel.get(timeout=60)
            except ChannelClosed:
                return seen
            if not isinstance(item, StepEnd):
                seen.append((item.producer, item.seq, item.step))
                if self.delay_s and len(seen) % self.slow_every == 0:
                    time.sleep(self.delay_s)

    def take(self, n: int) -> list:
        return [self.channel.get(timeout=30) for _ in range(n)]

    def wait_for_one(self) -> str:
        """Block in a get (nothing comes) until this process's handles are aborted; what ended it."""
        try:
            self.channel.get(timeout=60)
        except ChannelError as exc:
            return type(exc).__name__
        return "an item"

    def abort_handles(self) -> int:
        from rlinf_pipe.channels.channel import abort_process_handles

        return abort_process_handles()

    def open(self) -> None:
        self.channel.qsize()  # creates this process's consuming end (it starts granting credit)

    def open_refreshing_rarely(self) -> None:
        """Open this process's end with producers looked up once a minute once found, so that its housekeeping
        thread sleeps for half a heartbeat unless something wakes it."""
        from rlinf_pipe.channels import consumer

        consumer.REFRESH_S = 60.0
        self.channel.qsize()

    def busy(self, seconds: float) -> None:
        """Work that takes no item: nothing in this process asks for the channel's messages meanwhile."""
        time.sleep(seconds)


_names = iter(range(10_000))
_created: list[Channel] = []
nodes = nodes_fixture(_created)


def channel(item_type=Tagged, **spec) -> Channel:
    _created.append(Channel.create(f"test-{next(_names)}", item_type, **spec))
    return _created[-1]


def test_rich_items_roundtrip_across_nodes(nodes):
    ch = channel(Rich, maxsize=4)
    producer = on_node(Producer, nodes[1]).remote(ch)
    assert ray.get(producer.node_id.remote()) != ray.get_runtime_context().get_node_id()  # tcp path
    producer.put_rich.remote(5)
    got = [ch.get(timeout=60) for _ in range(6)]
    assert ch._consumer_end.endpoints()[0].startswith("tcp://")
    assert got[-1] == StepEnd(0)
    for step, item in enumerate(got[:5]):
        want = rich(step)
        assert item.step == step and item.version == want.version and item.optional is None
        assert item.inner.values.dtype == torch.bfloat16
        for a, b in zip(item.tensors, want.tensors, strict=True):
            assert_same(a, b)
        for key in want.by_name:
            assert_same(item.by_name[key], want.by_name[key])
    with pytest.raises(ChannelClosed):
        ch.get(timeout=30)


def test_same_node_roundtrip_uses_ipc(nodes):
    ch = channel(maxsize=8)
    producer = on_node(Producer, ray.get_runtime_context().get_node_id()).remote(ch, 7)
    producer.put_tagged.remote(20)
    assert [ch.get(timeout=60) for _ in range(21)] == [Tagged(7, i) for i in range(20)] + [StepEnd(0)]
    (endpoint,) = ch._consumer_end.endpoints()
    assert endpoint.startswith("ipc://@rlp-")  # Linux's abstract namespace: no socket file to leak
    ray.kill(producer)  # killed, so no clean-up of its own ran
    assert not list(Path(tempfile.gettempdir()).glob(f"{endpoint.removeprefix('ipc://@')}*"))


def test_a_put_that_finds_credit_sends_a_large_item_itself_and_leaves_small_ones_to_the_io_thread(nodes):
    """No hand-off to the producer's I/O thread for an item of DIRECT_BYTES or more while a consumer has credit (a
    put neither wakes the thread nor leaves it the send); a small item wakes it (it sends what gathered in one
    message); an item put before any consumer had credit goes out from the I/O thread once credit arrives."""
    ch = channel(Any, maxsize=16, prefetch=8)

    def item(seq: int, nbytes: int = DIRECT_BYTES) -> list:
        return [seq, np.full(nbytes, seq, dtype=np.uint8)]

    ch.put(item(0))  # no consumer yet: it waits in the producer's queue
    end = ch._producer_end()
    senders, rings = [], []
    send, ring = end._send, end._bell.ring

    def recording_send(cid, kind, *payload, **options):
        if kind == wire.ITEM:
            senders.append(threading.get_ident())
        return send(cid, kind, *payload, **options)

    end._send = recording_send
    end._bell.ring = lambda: (rings.append(1), ring())
    consumer = on_node(Consumer, nodes[0]).remote(ch)
    assert [seq for seq, _ in ray.get(consumer.take.remote(1))] == [0]
    assert senders == [end._thread.ident]  # sent when the consumer's credit arrived
    for seq in range(1, 4):
        ch.put(item(seq))
    asyncio.run(ch.aput(item(4)))  # (from an event loop alike)
    assert senders[1:] == [threading.get_ident()] * 4 and not rings
    ch.put(item(5, nbytes=8))
    taken = ray.get(consumer.take.remote(5))
    assert [seq for seq, _ in taken] == [1, 2, 3, 4, 5] and all((data == seq).all() for seq, data in taken)
    assert senders[5:] == [end._thread.ident] and rings


def test_a_take_is_reported_soon_while_the_consumer_stays_busy(nodes):
    """A take below the report batch is reported REPORT_DELAY_S later by the consumer's housekeeping thread, which a
    take wakes when it would sleep longer (here half a 40 s heartbeat): a producer blocked at maxsize is released
    at once, not when the thread happens to wake."""
    ch = channel(maxsize=16, prefetch=16, heartbeat_s=40.0, peer_timeout_s=120.0)
    ch.put(Tagged(0, 0))
    consumer = on_node(Consumer, nodes[0]).remote(ch)
    ray.get(consumer.open_refreshing_rarely.remote())
    for seq in range(1, 16):
        ch.put(Tagged(0, seq))  # maxsize reached: the next put waits for a take to be reported
    assert ray.get(consumer.take.remote(1)) == [Tagged(0, 0)]  # then the consumer takes nothing more
    ch.put(Tagged(0, 16), timeout=10)  # (without the wake-up: about 20 s)


def test_a_signal_during_a_puts_send_ends_the_producer_and_is_raised_as_is(nodes):
    """A signal's handler may raise between two frames of a message a put sends; nothing may be sent after half a
    message, so the I/O thread stops before using the socket again, the exception (here `RunStopped`) reaches the
    caller unchanged, and later puts fail."""
    from rlinf_pipe.errors import RunStopped

    ch = channel(Any, maxsize=16, prefetch=8)
    ch.put([0, np.zeros(8, dtype=np.uint8)])
    consumer = on_node(Consumer, nodes[0]).remote(ch)
    assert [seq for seq, _ in ray.get(consumer.take.remote(1))] == [0]  # (credit has arrived)
    end = ch._producer_end()

    def interrupted() -> bool:
        raise RunStopped(2, "stopped between two frames")

    end._pump = interrupted
    with pytest.raises(RunStopped):
        ch.put([1, np.zeros(DIRECT_BYTES, dtype=np.uint8)])
    end._thread.join(timeout=30)
    assert not end._thread.is_alive()
    with pytest.raises(ChannelPeerError, match="stopped between two frames"):
        ch.put([2, np.zeros(8, dtype=np.uint8)])


def test_a_batch_that_finds_its_consumer_gone_goes_back_in_order(nodes):
    """When a batch's send finds its consumer disconnected, the batch and the consumer's unacknowledged items (sent
    earlier) go back to the queue in the order they were put, ahead of the other consumers' next sends."""
    end = channel(maxsize=16, prefetch=8)._producer_end()
    items = [OutItem(seq, 0, 1.0, b"", [], 0) for seq in range(1, 5)]
    with end._waiter.lock:  # (the I/O thread waits meanwhile)
        gone = end._consumers[b"gone"] = ConsumerLink(time.monotonic(), inflight={1: items[0], 2: items[1]})
        end._queue.extend(items[2:])
        end._credits.extend([b"gone"] * 2)
        end._dispatch()  # ROUTER_MANDATORY refuses the unknown peer, as it does a disconnected one
        assert [item.seq for item in end._queue] == [1, 2, 3, 4]
        assert gone.dead == "disconnected" and not end._credits


def test_producer_blocks_at_capacity_and_resumes_when_the_consumer_drains(nodes):
    ch = channel(maxsize=4, prefetch=2)
    ch.qsize()  # the consumer is connected but takes nothing
    producer = on_node(Producer, nodes[1]).remote(ch)
    assert ray.get(producer.put_until_blocked.remote(20, 1.0)) == 4  # blocked at capacity
    assert [ch.get(timeout=30).seq for _ in range(3)] == [0, 1, 2]
    deadline = time.monotonic() + 30
    while ray.get(producer.untaken.remote()) != 1:  # the 3 takes reached the producer (1 s is no bound on a busy host)
        assert time.monotonic() < deadline
    assert ray.get(producer.put_until_blocked.remote(20, 1.0)) == 3  # resumed: exactly the freed room


def test_many_producers_many_consumers_across_nodes(nodes):
    ch = channel(maxsize=8, prefetch=2, num_producers=3)
    consumers = [on_node(Consumer, nodes[0]).remote(ch, 0.02), on_node(Consumer, nodes[1]).remote(ch, 0.0)]
    drained = [c.drain.remote() for c in consumers]
    producers = [on_node(Producer, nodes[p % 2]).remote(ch, p) for p in range(3)]
    assert ray.get([p.put_tagged.remote(150, steps=2) for p in producers]) == [300] * 3
    slow, fast = ray.get(drained)
    everything = sorted(slow + fast)
    assert everything == sorted((p, s, step) for p in range(3) for step in range(2) for s in range(150))
    for received in (slow, fast):  # per-producer order holds at every consumer
        for p in range(3):
            mine = [(step, seq) for producer, seq, step in received if producer == p]
            assert mine == sorted(mine)
    assert len(slow) < len(fast)  # work pulling: the slow consumer is sent less


def test_step_end_waits_for_every_producer(nodes):
    ch = channel(maxsize=16, num_producers=2)
    first, second = (on_node(Producer, nodes[i]).remote(ch, i) for i in range(2))
    ray.get(first.put_tagged.remote(3, steps=2, close=False))  # producer 0 already ended steps 0 and 1
    got = [ch.get(timeout=30) for _ in range(3)]
    assert sorted(t.seq for t in got) == [0, 1, 2] and all(t.step == 0 for t in got)
    with pytest.raises(ChannelTimeout):
        ch.get(timeout=0.5)  # producer 1 has not ended step 0: no StepEnd, and no step-1 item either
    ray.get(second.put_tagged.remote(1, steps=1, close=False))
    assert ch.get(timeout=30) == Tagged(1, 0, 0)
    assert ch.get(timeout=30) == StepEnd(0)
    assert [ch.get(timeout=30).step for _ in range(3)] == [1, 1, 1]


def test_close_semantics(nodes):
    ch = channel(maxsize=4)
    producer = on_node(Producer, nodes[1]).remote(ch)
    closed = producer.put_tagged.remote(2)  # its close() waits until a consumer took every item
    assert [ch.get(timeout=30) for _ in range(3)] == [Tagged(0, 0), Tagged(0, 1), StepEnd(0)]
    ray.get(closed)
    with pytest.raises(ChannelClosed):
        ch.get(timeout=30)
    ch.close()
    with pytest.raises(ChannelClosed, match="after close"):
        ch.get()
    with pytest.raises(ChannelClosed, match="after close"):
        ch.put(Tagged(0, 0))


def test_unknown_channel_and_spec_mismatch(nodes):
    with pytest.raises(ChannelError, match="does not exist; create it first"):
        Channel.open("never-created")
    Channel.create("fixed", maxsize=4)
    with pytest.raises(ChannelError, match="already exists with a different spec"):
        Channel.create("fixed", maxsize=8)


def test_dead_producer_fails_a_blocked_get_naming_it(nodes):
    ch = channel(maxsize=8, **FAST_FAILURE)
    producer = on_node(Producer, nodes[1]).remote(ch)
    ray.get(producer.put_tagged.remote(2, steps=1, close=False))
    assert [ch.get(timeout=30) for _ in range(3)][-1] == StepEnd(0)
    ray.get(producer.put_until_blocked.remote(1, 5.0))  # one item of step 1, then the producer dies
    ray.kill(producer)
    assert ch.get(timeout=30).seq == 0  # what it sent is not lost
    with pytest.raises(ChannelPeerError, match=r"producer producer@.*stopped responding.*step 1 cannot complete"):
        ch.get(timeout=30)  # (well before: the peer timeout is 3 s; a get that timed out would say so)


def test_dead_consumer_fails_a_blocked_put_naming_it(nodes):
    ch = channel(maxsize=2, prefetch=1, **FAST_FAILURE)
    consumer = on_node(Consumer, nodes[1]).remote(ch)
    ch.put(Tagged(0, 0))
    ch.put(Tagged(0, 1))
    assert [t.seq for t in ray.get(consumer.take.remote(1))] == [0]  # connected, and took one
    ray.kill(consumer)
    ch.put(Tagged(0, 2))  # room for one more
    with pytest.raises(ChannelPeerError, match=r"every consumer is gone: consumer@.*(stopped responding|disconnected)"):
        ch.put(Tagged(0, 3), timeout=30)


def test_a_dying_consumers_untaken_items_go_to_another(nodes):
    ch = channel(maxsize=20, prefetch=10, **FAST_FAILURE)
    doomed = on_node(Consumer, nodes[1]).remote(ch)
    ray.get(doomed.open.remote())
    producer = on_node(Producer, nodes[0]).remote(ch)
    ray.get(producer.put_tagged.remote(10, steps=1, close=False))  # all 10 go to the only consumer
    taken = ray.get(doomed.take.remote(3))
    deadline = time.monotonic() + 30
    while ray.get(producer.untaken.remote()) != 7:  # the 3 acknowledgements reached the producer
        assert time.monotonic() < deadline
    ray.kill(doomed)
    survivor = on_node(Consumer, nodes[0]).remote(ch)
    rest = ray.get(survivor.take.remote(8))
    assert [t.seq for t in taken] == [0, 1, 2]
    assert [t.seq for t in rest[:7]] == [3, 4, 5, 6, 7, 8, 9] and rest[7] == StepEnd(0)


def test_forty_thousand_small_items_two_producers_two_consumers_one_slow(nodes):
    """The stress shape of `benchmarks/channel_stress.py` (which runs it with a million items) at suite size: every
    item arrives exactly once, each producer's items in order, and the slow consumer gets fewer."""
    ch = channel(maxsize=512, prefetch=256, num_producers=2)
    consumers = [on_node(Consumer, nodes[0]).remote(ch, 0.001), on_node(Consumer, nodes[1]).remote(ch)]  # <= 1k/s
    drained = [c.drain.remote() for c in consumers]
    producers = [on_node(Producer, nodes[p]).remote(ch, p) for p in range(2)]
    assert ray.get([p.put_tagged.remote(20_000) for p in producers]) == [20_000, 20_000]
    slow, fast = ray.get(drained, timeout=300)
    assert sorted(slow + fast) == [(p, s, 0) for p in range(2) for s in range(20_000)]  # none lost, none twice
    for received in (slow, fast):
        for p in range(2):
            mine = [seq for producer, seq, _ in received if producer == p]
            assert mine == sorted(mine)
    assert len(slow) < len(fast), (len(slow), len(fast))


async def test_async_put_and_get(nodes):
    ch = channel(maxsize=4)
    producer = on_node(Producer, nodes[1]).remote(ch)
    ref = producer.put_tagged.remote(10)
    items = [await ch.aget(timeout=30) for _ in range(11)]
    assert items[-1] == StepEnd(0) and [t.seq for t in items[:10]] == list(range(10))
    await ref
    reply = channel(maxsize=4)
    for i in range(3):
        await reply.aput(Tagged(9, i))
    consumer = on_node(Consumer, nodes[1]).remote(reply)
    taken = consumer.take.remote(4)
    await reply.aclose(timeout=30)  # awaits the drain: the consumer took all three
    assert [t.seq for t in (await taken)[:3]] == [0, 1, 2] and (await taken)[3] == StepEnd(0)


async def test_two_tasks_of_one_event_loop_share_a_channels_items(nodes):
    """Both wait on the same sockets through the loop; each item reaches exactly one of them, in order per task."""
    ch = channel(maxsize=8, prefetch=4)
    producer = on_node(Producer, nodes[1]).remote(ch)
    ref = producer.put_tagged.remote(40)

    async def take_until_the_end() -> list[int]:
        seen = []
        while True:
            try:
                item = await ch.aget(timeout=30)
            except ChannelClosed:
                return seen
            if not isinstance(item, StepEnd):
                seen.append(item.seq)

    first, second = await asyncio.gather(take_until_the_end(), take_until_the_end())
    await ref
    assert sorted(first + second) == list(range(40)) and first == sorted(first) and second == sorted(second)


def test_a_consumer_busy_for_longer_than_the_peer_timeout_is_not_given_up(nodes):
    """While the app works without taking, its process still answers heartbeats and hears the producer's (the
    housekeeping thread receives what waits): neither end gives the other up, and every item arrives."""
    ch = channel(maxsize=8, prefetch=4, **FAST_FAILURE)
    consumer = on_node(Consumer, nodes[1]).remote(ch)
    ray.get(consumer.open.remote())
    producer = on_node(Producer, nodes[0]).remote(ch)
    ray.get(producer.put_tagged.remote(6, steps=1, close=False))
    ray.get(consumer.busy.remote(2 * FAST_FAILURE["peer_timeout_s"]))
    items = ray.get(consumer.take.remote(7), timeout=60)
    assert [t.seq for t in items[:6]] == list(range(6)) and items[6] == StepEnd(0)
    waiting = consumer.take.remote(4)  # waits for the next step (a producer it had given up on would fail it)
    ray.get(producer.put_tagged.remote(3, steps=1, close=False))
    assert [t.seq for t in ray.get(waiting, timeout=60)[:3]] == [0, 1, 2]


def test_delivery_is_at_least_once_when_a_consumer_dies(nodes):
    """Killed right after taking items (their hand-over reports may still be in flight): nothing is lost, and the
    only items delivered twice are ones the dead consumer took."""
    ch = channel(maxsize=40, prefetch=10, **FAST_FAILURE)
    doomed = on_node(Consumer, nodes[1]).remote(ch)
    ray.get(doomed.open.remote())
    producer = on_node(Producer, nodes[0]).remote(ch)
    ray.get(producer.put_tagged.remote(30, steps=1, close=False))
    taken = [t.seq for t in ray.get(doomed.take.remote(5))]
    ray.kill(doomed)  # at once: no waiting for the producer to hear of the five
    survivor = on_node(Consumer, nodes[0]).remote(ch)
    rest = ray.get(survivor.take.remote(30 - len(taken) + 1), timeout=120)  # at least everything not taken
    more = [t.seq for t in rest if isinstance(t, Tagged)]
    while not any(isinstance(t, StepEnd) for t in rest):  # redelivered duplicates come before the step end
        rest = ray.get(survivor.take.remote(1), timeout=60)
        more += [t.seq for t in rest if isinstance(t, Tagged)]
    assert set(more) >= set(range(30)) - set(taken)  # nothing lost
    assert len(more) == len(set(more))  # the survivor gets each item once; a repeat can only be of `taken`


def test_aborting_a_process_handles_ends_its_waiting_get_and_put_at_once(nodes):
    """What a worker abandoning a step does (`Worker.abandon_step`): a get waiting in another thread raises
    ChannelClosed at once (it would wait for its producer forever), and so does a put waiting for credit."""
    ch = channel(maxsize=4, **FAST_FAILURE)
    consumer = on_node(Consumer, nodes[1], max_concurrency=2).remote(ch)
    waiting = consumer.wait_for_one.remote()
    assert ray.wait([waiting], timeout=0.5)[0] == []  # blocked: nothing was put
    assert ray.get(consumer.abort_handles.remote()) == 1
    assert ray.get(waiting, timeout=30) == "ChannelClosed"  # (not its own timeout's ChannelTimeout, after 60 s)

    blocked = channel(maxsize=1, **FAST_FAILURE)
    taker = on_node(Consumer, nodes[1]).remote(blocked)
    ray.get(taker.open.remote())  # a live consumer that takes nothing: the producer runs out of credit
    producer = on_node(Producer, nodes[0], max_concurrency=2).remote(blocked)
    putting = producer.put_until_blocked.remote(10, 60.0)
    assert ray.wait([putting], timeout=1.0)[0] == []  # one item went in, the next put waits
    ray.get(producer.abort_handles.remote())
    with pytest.raises(ray.exceptions.RayTaskError, match="ChannelClosed"):
        ray.get(putting, timeout=30)


def test_a_producer_aborted_with_items_untaken_is_a_failure_to_consumers_that_connect_later(nodes):
    """Not a clean end of the stream: a consumer arriving after it must not end its step with items missing."""
    from rlinf_pipe.channels.registry import registry

    ch = channel(maxsize=8, **FAST_FAILURE)
    producer = on_node(Producer, nodes[1]).remote(ch)
    assert ray.get(producer.put_tagged.remote(3, close=False)) == 3  # no consumer yet: nothing is taken
    ray.get(producer.abort_handles.remote())
    deadline = time.monotonic() + 30
    while not (records := ray.get(registry().list_producers.remote(ch.name))) or records[0].failure is None:
        assert time.monotonic() < deadline, "the producer never told the registry it is gone"
        time.sleep(0.02)  # (a round trip each: leave the cores to the producer)
    assert not records[0].closed and "was aborted with 3 item(s) not taken" in records[0].failure
    with pytest.raises(ChannelPeerError, match=r"was aborted with 3 item\(s\) not taken.*step 0 cannot complete"):
        ch.get(timeout=30)


def test_a_consumer_connected_to_a_producer_that_fails_learns_it_from_the_registry(nodes):
    """The producer says nothing on its socket before going: without the registry, a waiting get would see it only
    after `peer_timeout_s` (30 s here), as a producer that stopped responding."""
    ch = channel(maxsize=8, heartbeat_s=0.2, peer_timeout_s=30.0)
    consumer = on_node(Consumer, nodes[0], max_concurrency=2).remote(ch)
    ray.get(consumer.open.remote())
    producer = on_node(Producer, nodes[1]).remote(ch)
    ray.get(producer.put_tagged.remote(2, close=False))
    assert [t.seq for t in ray.get(consumer.take.remote(2))] == [0, 1]
    ray.get(producer.put_tagged.remote(1, steps=1, close=False))  # step 1's item, then the producer goes
    ray.get(producer.abort_handles.remote())
    # (the registry's word, asked every second: after the peer timeout, 30 s, it would say "stopped responding")
    with pytest.raises(ray.exceptions.RayTaskError, match=r"was aborted with \d item\(s\) not taken"):
        ray.get(consumer.drain.remote(), timeout=60)


def test_a_producer_that_closed_as_a_consumer_connected_is_seen_closed_through_the_registry(nodes):
    """A producer closes once other consumers took every item it put. A consumer that found it in the registry just
    before may connect as its socket closes: the hello is never read and nothing more comes (a CI run waited for it
    until the peer timeout, then failed the step). The registry's record of the clean close must end it instead."""
    from rlinf_pipe.channels.registry import ProducerRecord, registry

    ch = channel(maxsize=8, heartbeat_s=0.2, peer_timeout_s=30.0)
    gone = ProducerRecord(  # a socket nobody reads (a closed producer's)
        id="producer@closed-unread",
        node_id=nodes[0],
        ipc=f"ipc://{tempfile.gettempdir()}/rlinf-pipe-test-{ch.name}-never-bound",
        tcp="tcp://127.0.0.1:1",
    )
    ray.get(registry().add_producer.remote(ch.name, gone))
    ch.qsize()  # this process's consuming end connects to it
    assert ch._consumer_end.endpoints() == [gone.ipc]
    ray.get(registry().close_producer.remote(ch.name, gone.id, 0))  # it closed after ending step 0
    assert ch.get(timeout=10) == StepEnd(0)
    with pytest.raises(ChannelClosed, match="every producer closed"):
        ch.get(timeout=10)


class StalledRegistry:
    """Stands in for a consumer's handle on the registry: each `list_producers` is answered (by the registry) only
    once `release` is set."""

    def __init__(self, real: Any):
        self.real, self.asked, self.release = real, threading.Event(), threading.Event()
        self.list_producers = SimpleNamespace(remote=self._remote)

    def _remote(self, name: str) -> Any:
        self.asked.set()
        answer: concurrent.futures.Future = concurrent.futures.Future()
        ref = self.real.list_producers.remote(name)

        def later() -> None:
            self.release.wait()
            answer.set_result(ray.get(ref))

        threading.Thread(target=later, daemon=True).start()
        return SimpleNamespace(future=lambda: answer)


def test_a_registry_slow_to_answer_does_not_silence_a_consumer(nodes):
    """The housekeeping thread asks the registry every second and sends the heartbeats: waiting for an answer that
    takes longer than the peer timeout, it fell silent, and the producers gave the consumer up (its items would go
    to other consumers)."""
    ch = channel(maxsize=8, **FAST_FAILURE)
    producer = on_node(Producer, nodes[1]).remote(ch)
    ray.get(producer.put_tagged.remote(1, close=False))
    assert ch.get(timeout=30) == Tagged(0, 0)  # connected: the producer knows this consumer
    end = ch._consumer_end
    stalled = StalledRegistry(end._registry)
    end._registry = stalled
    assert stalled.asked.wait(timeout=30)  # the housekeeping thread's next look is waiting for its answer
    time.sleep(2 * FAST_FAILURE["peer_timeout_s"])  # (the scenario itself: an answer slower than the peer timeout)
    stalled.release.set()
    assert ray.get(producer.given_up.remote()) == []
    assert ch.get(timeout=30) == StepEnd(0)


def test_ray_going_away_under_a_consumer_ends_its_calls_with_channel_closed(nodes):
    """The housekeeping thread ends when Ray does (no `stop`): a take, `qsize`, `stats` and `iter_step` then say
    so instead of using the sockets that thread closed (or ending the step quietly)."""
    ch = channel(**FAST_FAILURE)
    ch.qsize()  # this process's consuming end
    end = ch._consumer_end
    end._ray_alive = lambda: False
    end._bell.ring()
    end._thread.join(timeout=30)
    assert not end._thread.is_alive()
    with pytest.raises(ChannelClosed, match="Ray shut down under this process"):
        ch.get(timeout=5)
    with pytest.raises(ChannelClosed, match="Ray shut down under this process"):
        list(ch.iter_step(timeout=5))
    assert ch.qsize() == 0 and ch.stats()["buffered_items"] == 0


def test_a_consumer_holding_only_a_later_steps_items_still_receives_the_current_steps_items_sent_again(nodes):
    """The driver's buffer holds step 1's items, as many as its credit; step 0's items come back from a consumer
    that died. Without one more credit from the driver, they could reach no consumer and step 0 would never end."""
    ch = channel(maxsize=64, prefetch=2, **FAST_FAILURE)
    producer = on_node(Producer, nodes[0]).remote(ch)
    ray.get(producer.open.remote())
    doomed = on_node(Consumer, nodes[1]).remote(ch)
    ray.get(doomed.open.remote())
    deadline = time.monotonic() + 30
    while ray.get(producer.consumers.remote()) < 1:  # (its credit comes first)
        assert time.monotonic() < deadline
        time.sleep(0.02)
    ch.qsize()  # the driver's consuming end
    while ray.get(producer.consumers.remote()) < 2:
        assert time.monotonic() < deadline
        time.sleep(0.02)
    ray.get(producer.put_step.remote([0, 1]))  # step 0: both to the doomed consumer, which takes none
    ray.get(producer.put_step.remote([10, 11]))  # step 1: both to the driver, which has no credit left
    while ch.qsize() < 2:
        assert time.monotonic() < deadline
    ray.kill(doomed)  # step 0's items go back to the producer's queue
    got = [ch.get(timeout=30) for _ in range(6)]
    assert got == [Tagged(0, 0), Tagged(0, 1), StepEnd(0), Tagged(0, 10), Tagged(0, 11), StepEnd(1)]


def _stranger(context: Any, endpoint: str, password: bytes | None) -> tuple[Any, Any]:
    """A DEALER of another process (its own ZeroMQ context) that connects to a producer, as a consumer would, with
    `password` (None: no credentials at all) and grants it credit; and its monitor."""
    import zmq

    sock = context.socket(zmq.DEALER)
    sock.linger = 0
    if password is not None:
        sock.plain_username, sock.plain_password = b"rlinf-pipe", password
    monitor = sock.get_monitor_socket()
    sock.connect(endpoint)
    try:
        sock.send_multipart([wire.HELLO, wire.pack([1000, None, b"nonce"])], zmq.NOBLOCK)
    except zmq.Again:  # (refused already: its pipe is gone)
        pass
    return sock, monitor


def _refused(monitor: Any) -> bool:
    """Whether the stranger's handshake failed (wait for the outcome up to 60 s)."""
    import zmq
    from zmq.utils.monitor import recv_monitor_message

    failed = zmq.EVENT_HANDSHAKE_FAILED_AUTH | zmq.EVENT_HANDSHAKE_FAILED_PROTOCOL
    while monitor.poll(60_000):
        event = recv_monitor_message(monitor)["event"]
        if event & (failed | zmq.EVENT_HANDSHAKE_SUCCEEDED):
            return bool(event & failed)
    return False


def test_strangers_at_a_producers_tcp_port_and_local_socket_get_nothing_and_cost_no_item(nodes):
    """Processes that do not hold the run's channel key (no credentials, or another run's) connect to the
    producer's tcp port (bound to the node's cluster address, not every interface) and to its abstract unix
    socket, and grant credit: they are refused at the handshake, the refused addresses are noted once, and the
    real consumer receives every item (the producer's close, which waits until every item is taken, returns)."""
    import zmq

    from rlinf_pipe.channels import gate
    from rlinf_pipe.channels.registry import registry

    ch = channel(maxsize=None, prefetch=4)
    producer = on_node(Producer, nodes[1]).remote(ch)
    ray.get(producer.open.remote())
    (record,) = ray.get(registry().list_producers.remote(ch.name))
    assert ray.get(producer.tcp_bound.remote()) == record.tcp  # (was tcp://0.0.0.0:<port>: every interface)
    assert record.tcp.startswith(f"tcp://{ray.util.get_node_ip_address()}:")
    context = zmq.Context()
    another_runs = gate.password(gate.ChannelKey.new(), record.id)
    strangers = [_stranger(context, endpoint, password) for endpoint in (record.tcp, record.ipc)
                 for password in (None, another_runs)]
    assert all(_refused(monitor) for _, monitor in strangers)
    me = f"a local process (pid {os.getpid()}, uid {os.getuid()})"
    assert sorted(ray.get(producer.refused.remote())) == sorted([ray.util.get_node_ip_address(), me])

    done = producer.put_tagged.remote(30)  # (closes: returns once a consumer took every item)
    consumer = on_node(Consumer, nodes[0]).remote(ch)
    assert ray.get(consumer.take.remote(31), timeout=120) == [Tagged(0, i) for i in range(30)] + [StepEnd(0)]
    assert ray.get(done, timeout=60) == 30
    for sock, monitor in strangers:
        assert not sock.poll(0)  # sent nothing
        sock.disable_monitor()
        monitor.close(linger=0)
        sock.close(linger=0)
    context.term()


def test_a_consumer_hears_nothing_from_a_process_that_cannot_prove_the_key(nodes):
    """A process listening at a registered producer's address (as one that took a dead producer's port or name
    would) accepts the consumer's connection and sends it a state and an item: the consumer ignores both."""
    import msgspec
    import zmq

    from rlinf_pipe.channels.registry import ProducerRecord, registry

    ch = channel(maxsize=8, **FAST_FAILURE)
    context = zmq.Context()  # the impostor's, with a handler that lets any PLAIN client in
    handler = context.socket(zmq.REP)
    handler.bind("inproc://zeromq.zap.01")
    impostor = context.socket(zmq.ROUTER)
    impostor.plain_server = True
    local = f"ipc://@rlp-test-impostor-{ch.name}"
    impostor.bind(local)
    record = ProducerRecord(id="producer@impostor", node_id=nodes[0], ipc=local, tcp="tcp://127.0.0.1:1")
    ray.get(registry().add_producer.remote(ch.name, record))
    ch.qsize()  # this process's consuming end connects to it
    assert handler.poll(60_000)
    request = handler.recv_multipart()
    handler.send_multipart([request[0], request[1], b"200", b"OK", b"", b""])
    assert impostor.poll(60_000)
    consumer_id, kind, _hello = impostor.recv_multipart()
    assert kind == wire.HELLO
    header = msgspec.msgpack.encode(Tagged(9, 9))
    impostor.send_multipart([consumer_id, wire.STATE, wire.pack([-1, False, b"\0" * 32])])
    impostor.send_multipart([consumer_id, wire.ITEM, wire.pack([[1, 0, 1.0, header, 0]])])
    link = ch._consumer_end._links[record.id]
    assert wait_for(lambda: ch.qsize() > 0 or link.unproven >= 2, 60), "the impostor's messages never arrived"
    assert link.unproven == 2 and ch.qsize() == 0 and link.proof is not None  # (qsize receives what waits)
    impostor.close(linger=0)
    handler.close(linger=0)
    context.term()


def test_an_encrypted_channel_delivers_across_nodes_and_on_one(nodes):
    """`encrypt=True` (CURVE): items from a producer on the other node (tcp) and on this one (ipc) arrive."""
    ch = channel(maxsize=8, num_producers=2, encrypt=True)
    producers = [on_node(Producer, nodes[i]).remote(ch, i) for i in range(2)]
    done = [p.put_tagged.remote(10) for p in producers]
    got = [ch.get(timeout=60) for _ in range(21)]
    assert got[-1] == StepEnd(0)
    assert sorted(got[:-1], key=lambda t: (t.producer, t.seq)) == [Tagged(p, i) for p in range(2) for i in range(10)]
    assert sorted(e.split(":")[0] for e in ch._consumer_end.endpoints()) == ["ipc", "tcp"]
    assert ray.get(done, timeout=60) == [10, 10]
