"""Large item buffers through a producer's shared memory (`channels/arena.py`), between real processes
on a two-node Ray cluster (one machine): exact bytes, regions released when the app lets go, a full arena falling
back to the socket, consumers that leave or die, and no sharing across nodes."""

from __future__ import annotations

import sys
import threading
import time

import ray
import torch
from support.channel_cluster import nodes_fixture, on_node
from support.channel_items import BIG, Big, assert_exact, big

from rlinf_pipe.channels import Channel, StepEnd
from rlinf_pipe.channels.arena import ALIGN

PER_ITEM = sum(-(-nbytes // ALIGN) * ALIGN for nbytes in (BIG, 100_000))  # arena bytes of a Big item

ray.cloudpickle.register_pickle_by_value(sys.modules[__name__])


@ray.remote(num_cpus=0)
class Producer:
    def __init__(self, channel: Channel):
        self.channel = channel
        self.resume = threading.Event()

    def put(self, seqs: list[int], close: bool = False) -> None:
        for seq in seqs:
            self.channel.put(big(seq))
        self.channel.end_step()
        if close:
            self.channel.close()

    def shared_bytes_used(self) -> int:
        return self.channel.stats()["shared_bytes_used"]

    def shared_bytes_overflow(self) -> int:
        return self.channel.stats()["shared_bytes_overflow"]

    def untaken(self) -> float:
        return self.channel.stats()["untaken_items"]

    def open(self) -> None:
        self.channel._producer_end()  # (this process's producing end, before any put)

    def consumers(self) -> int:
        return len(self.channel._producer._consumers)

    def given_up(self) -> list[str]:
        """Why each consumer the producing end gave up went."""
        return [link.dead for link in self.channel._producer._consumers.values() if link.dead]

    def pause_io(self) -> None:
        """Hold the producing end's lock (in a thread of its own) until `resume_io`: its I/O thread reads nothing."""
        held, self.resume = threading.Event(), threading.Event()

        def hold() -> None:
            with self.channel._producer._waiter.lock:
                held.set()
                self.resume.wait()

        threading.Thread(target=hold, daemon=True).start()
        held.wait()

    def resume_io(self) -> None:
        self.resume.set()


@ray.remote(num_cpus=0)
class Consumer:
    def __init__(self, channel: Channel):
        self.channel, self.held = channel, []

    def open(self) -> None:
        self.channel.qsize()

    def take_and_hold(self, n: int) -> list[int]:
        self.held += [self.channel.get(timeout=60) for _ in range(n)]
        return [item.seq for item in self.held]

    def buffered(self) -> int:
        return self.channel.qsize()

    def take_exact_and_drop(self, n: int) -> list[int]:
        """Take `n` items one at a time, checking each and letting it go before the next."""
        seqs = []
        for _ in range(n):
            item = self.channel.get(timeout=60)
            assert_exact(item)
            seqs.append(item.seq)
            del item
        return seqs

    def wait_to_leave(self, seconds: float) -> None:
        """How long this process's closes wait for their producers' answers (`consumer.LEAVE_WAIT_S`)."""
        from rlinf_pipe.channels import consumer

        consumer.LEAVE_WAIT_S = seconds

    def drop_and_close(self) -> None:
        self.held.clear()
        self.channel.close()


_names = iter(range(10_000))
_created: list[Channel] = []
nodes = nodes_fixture(_created)


def channel(**spec) -> Channel:
    _created.append(Channel.create(f"shm-{next(_names)}", Big, heartbeat_s=0.2, **spec))
    return _created[-1]


def in_arena(ch: Channel, tensor: torch.Tensor) -> bool:
    """Whether `tensor` views the mapped arena of one of `ch`'s producers."""
    for arena in ch._consumer_end._arenas.values():
        start = arena._mapping.ctypes.data
        if start <= tensor.data_ptr() < start + len(arena._mapping):
            return True
    return False


def wait_until(condition, what: str, timeout: float = 30.0) -> None:
    """Ask `condition` until it holds (a few times a second: each ask is a round trip to a worker)."""
    deadline = time.monotonic() + timeout
    while not condition():
        assert time.monotonic() < deadline, f"timed out waiting until {what}"
        time.sleep(0.02)  # (not a synchronisation: it leaves the 2 cores to the processes asked)


def test_large_buffers_on_one_node_arrive_exactly_through_shared_memory_until_the_app_lets_go(nodes):
    ch = channel(maxsize=16, prefetch=8)
    producer = on_node(Producer, nodes[0]).remote(ch)
    ray.get(producer.put.remote(list(range(6))))
    items = [ch.get(timeout=60) for _ in range(6)]
    assert ch.get(timeout=60) == StepEnd(0)
    for seq, item in enumerate(items):
        assert item.seq == seq
        assert_exact(item)
        assert in_arena(ch, item.large) and not in_arena(ch, item.small)
    held = ray.get(producer.shared_bytes_used.remote())
    assert held >= 6 * (BIG + 100_000)  # every region is the consumer's while its arrays live
    assert ray.get(producer.shared_bytes_overflow.remote()) == 0
    items[0].large.fill_(7)  # private to this process until released: writable, and nobody else's
    assert_exact(items[1])
    del items, item
    wait_until(lambda: ray.get(producer.shared_bytes_used.remote()) == 0, "every region was released")


def test_a_full_arena_sends_the_rest_over_the_socket(nodes):
    ch = channel(maxsize=16, prefetch=8, shared_bytes=2 * PER_ITEM)  # room for two items
    producer = on_node(Producer, nodes[0]).remote(ch)
    ray.get(producer.put.remote(list(range(6))))
    items = [ch.get(timeout=60) for _ in range(6)]
    for item in items:
        assert_exact(item)
    placed = sum(in_arena(ch, item.large) for item in items)
    assert placed == 2  # (the driver holds them: the next ones find no room, and it has nothing left to take)
    # what found no room is counted (every item's 100 KB array, and the large tensors of the items not placed)
    assert ray.get(producer.shared_bytes_overflow.remote()) >= (6 - placed) * BIG


def test_with_sharing_off_everything_goes_over_the_socket(nodes):
    ch = channel(shared_bytes=0)
    producer = on_node(Producer, nodes[0]).remote(ch)
    ray.get(producer.put.remote([0, 1]))
    items = [ch.get(timeout=60) for _ in range(2)]
    for item in items:
        assert_exact(item)
    assert ch._consumer_end._links and not ch._consumer_end._arenas  # (connected, nothing mapped)


def test_across_nodes_large_buffers_go_over_tcp(nodes):
    ch = channel()
    producer = on_node(Producer, nodes[1]).remote(ch)
    ray.get(producer.put.remote([0, 1, 2]))
    items = [ch.get(timeout=60) for _ in range(3)]
    for item in items:
        assert_exact(item)
    assert ch._consumer_end.endpoints()[0].startswith("tcp://")
    assert ch._consumer_end._links and not ch._consumer_end._arenas  # (connected, nothing mapped)
    assert ray.get(producer.shared_bytes_used.remote()) == 0


def test_a_consumer_that_leaves_frees_its_regions_and_its_untaken_items_reach_another_exactly(nodes):
    ch = channel(maxsize=16, prefetch=8)
    leaving = on_node(Consumer, nodes[0]).remote(ch)
    ray.get(leaving.open.remote())
    producer = on_node(Producer, nodes[0]).remote(ch)
    ray.get(producer.put.remote(list(range(5))))  # all five go to the only consumer, through the arena
    assert ray.get(leaving.take_and_hold.remote(2)) == [0, 1]
    ray.get(leaving.drop_and_close.remote())
    rest = [ch.get(timeout=60) for _ in range(3)]
    assert [item.seq for item in rest] == [2, 3, 4]
    for item in rest:
        assert_exact(item)
    del rest, item
    wait_until(lambda: ray.get(producer.shared_bytes_used.remote()) == 0, "every region was freed")


def test_a_consumers_close_returns_once_its_producer_heard_its_last_takes(nodes):
    """Closing a socket drops what it has not sent: a close that did not wait for the producer's answer lost the
    last takes whenever the consumer's I/O thread was starved for a moment, and the producer, once it gave the silent
    consumer up, sent the items it had taken to another consumer as well."""
    ch = channel(maxsize=16, prefetch=8)
    leaving = on_node(Consumer, nodes[0]).remote(ch)
    ray.get(leaving.open.remote())
    producer = on_node(Producer, nodes[0]).remote(ch)
    ray.get(producer.put.remote(list(range(3))))
    assert ray.get(leaving.take_and_hold.remote(2)) == [0, 1]
    ray.get(leaving.wait_to_leave.remote(30.0))  # (far longer than the wait below, however slow the host)
    ray.get(producer.pause_io.remote())
    closed = leaving.drop_and_close.remote()
    ready, _ = ray.wait([closed], timeout=1.0)
    assert not ready, "the consumer's close returned before its producer read a word of it"
    ray.get(producer.resume_io.remote())
    ray.get(closed)
    assert ray.get(producer.given_up.remote()) == ["closed its end"]
    assert ray.get(producer.untaken.remote()) == 1  # only item 2 went back to the queue
    rest = ch.get(timeout=60)
    assert rest.seq == 2
    assert_exact(rest)


def test_a_killed_consumers_regions_are_freed_once_its_process_is_gone_and_its_items_reach_another_exactly(nodes):
    ch = channel(maxsize=16, prefetch=8, peer_timeout_s=3.0)
    doomed = on_node(Consumer, nodes[0]).remote(ch)
    ray.get(doomed.open.remote())
    producer = on_node(Producer, nodes[0]).remote(ch)
    ray.get(producer.put.remote(list(range(4))))
    assert ray.get(doomed.take_and_hold.remote(1)) == [0]
    used = lambda: ray.get(producer.shared_bytes_used.remote())  # noqa: E731
    wait_until(lambda: used() == 4 * PER_ITEM, "all four items went to the doomed consumer")
    wait_until(lambda: ray.get(producer.untaken.remote()) == 3, "the doomed consumer's take reached the producer")
    ray.kill(doomed)
    rest = [ch.get(timeout=60) for _ in range(3)]
    assert [item.seq for item in rest] == [1, 2, 3]
    for item in rest:
        assert_exact(item)
    # The items sent again got regions of their own (the killed consumer's four were not reused while it might
    # read them); once its process is gone, its four are free and only the survivor's three are held.
    wait_until(lambda: used() == 3 * PER_ITEM, "the killed consumer's regions were freed")
    assert all(in_arena(ch, item.large) for item in rest)
    del rest, item
    wait_until(lambda: used() == 0, "the survivor released its regions")


def test_a_consumer_with_items_to_take_waits_for_room_instead_of_being_sent_the_rest_over_the_socket(nodes):
    """A consumer that falls behind holds the arena with the items in its buffer; sending it more over the socket
    (dearer for both ends) would put it further behind. Once it has nothing left to take, it is sent over the
    socket rather than kept waiting (`test_a_full_arena_sends_the_rest_over_the_socket`)."""
    ch = channel(maxsize=16, prefetch=8, shared_bytes=2 * PER_ITEM)  # room for two items
    consumer = on_node(Consumer, nodes[0]).remote(ch)
    ray.get(consumer.open.remote())
    producer = on_node(Producer, nodes[0]).remote(ch)
    ray.get(producer.put.remote(list(range(6))))
    wait_until(lambda: ray.get(consumer.buffered.remote()) == 2, "two items reached the consumer, which takes none")
    assert ray.get(producer.shared_bytes_overflow.remote()) == 0  # the other four wait at the producer
    assert ray.get(producer.shared_bytes_used.remote()) == 2 * PER_ITEM
    assert ray.get(consumer.take_exact_and_drop.remote(6)) == list(range(6))
    assert ray.get(producer.shared_bytes_overflow.remote()) == 0  # all six went through the arena


def test_an_item_sent_again_is_not_kept_waiting_behind_a_later_steps_items(nodes):
    """A consumer's buffer full of step 1's items holds the arena, and a step-0 item comes back from a consumer that
    died: waiting for room would wait forever (the consumer takes nothing of step 1 before step 0 ends), so it goes
    over the socket."""
    ch = channel(maxsize=64, prefetch=4, shared_bytes=2 * PER_ITEM, peer_timeout_s=3.0)
    producer = on_node(Producer, nodes[0]).remote(ch)
    ray.get(producer.open.remote())
    doomed = on_node(Consumer, nodes[1]).remote(ch)  # (on the other node: its items go over tcp)
    ray.get(doomed.open.remote())
    wait_until(lambda: ray.get(producer.consumers.remote()) == 1, "the doomed consumer connected")
    ch.qsize()  # the driver's consuming end: its credit comes after the doomed one's
    wait_until(lambda: ray.get(producer.consumers.remote()) == 2, "the driver connected")
    ray.get(producer.put.remote([0, 1, 2, 3]))  # step 0: all four to the doomed consumer, which takes none
    ray.get(producer.put.remote([10, 11, 12, 13]))  # step 1: to the driver; two fill the arena, two wait for room
    wait_until(lambda: ray.get(producer.shared_bytes_used.remote()) == 2 * PER_ITEM, "step 1 filled the arena")
    ray.kill(doomed)  # its four step-0 items go back to the front of the queue
    got = [ch.get(timeout=30) for _ in range(10)]
    assert [g.step if isinstance(g, StepEnd) else g.seq for g in got] == [0, 1, 2, 3, 0, 10, 11, 12, 13, 1]
    for item in got:
        if not isinstance(item, StepEnd):
            assert_exact(item)
