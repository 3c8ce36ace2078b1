"""The producing end of a socket channel in one process.

Items wait in this process until a consumer has credit for them (consumers pull: each grants `prefetch` items per
producer and one more per item it takes). Sent items are kept until the consumer reports them taken, so a
consumer that dies loses nothing: every item it had not handed to its app goes to the other consumers. `put`
blocks while this producer's untaken weight is at `maxsize` (backpressure across processes and nodes). A step's
end is announced once every item of it has been taken out of some consumer's buffer. Large buffers bound for a
consumer on this node go through this producer's shared memory (`arena.py`) instead of the socket. Only peers that
prove the run's channel key get in (`gate.py`).
"""

from __future__ import annotations

import logging
import select
import threading
import time
from collections import deque
from typing import Any, Sequence

import msgspec
import ray
import zmq

from rlinf_pipe.errors import ChannelClosed, ChannelPeerError
from rlinf_pipe.channels import gate, wire
from rlinf_pipe.channels.arena import SharedArena, process_start
from rlinf_pipe.channels.buffer import PENDING, Waiter
from rlinf_pipe.channels.codec import Codec
from rlinf_pipe.channels.dispatch import next_message
from rlinf_pipe.channels.links import ConsumerLink, OutItem
from rlinf_pipe.channels.ready import Doorbell
from rlinf_pipe.channels.registry import ChannelSpec, ProducerRecord, registry, track_end
from rlinf_pipe.channels.wire import endpoint_id

log = logging.getLogger(__name__)
COPY_THRESHOLD = 512 * 1024  # bytes: smaller frames are copied when sent (see `ProducerEnd.__init__`)
# A `put` of an item this large that finds credit sends it itself. Smaller items are left to the I/O thread, which
# sends the items that gathered while it woke in one message: for small items fewer, larger messages beat the
# hand-off (2 producers x 2 consumers of tiny items moved half as many items/s when each put sent its own).
DIRECT_BYTES = 32 * 1024


class ProducerEnd:
    """Owns a ROUTER socket (ipc + tcp on the node's cluster address) that consumers connect to, once they prove
    the run's key. A `put` of a large item that finds credit sends it at once; an I/O thread sends the rest,
    announces step ends, and watches the consumers."""

    def __init__(self, spec: ChannelSpec, codec: Codec):
        self.spec, self.codec = spec, codec
        self.id = endpoint_id("producer")
        self._waiter = Waiter(threading.RLock())
        self._queue: deque[OutItem] = deque()
        self._consumers: dict[bytes, ConsumerLink] = {}
        self._credits: deque[bytes] = deque()
        self._outstanding: dict[int, int] = {}  # step -> items not yet taken
        self._untaken = 0.0
        self._seq = 0
        self._step = 0
        self._step_has_items = False
        self._ended: deque[int] = deque()  # ended steps whose marker is not yet broadcast
        self._ended_through = -1
        self._closing = self._closed = self._stopping = False
        self._error: BaseException | None = None
        self._arena = SharedArena.create(spec.shared_bytes, f"channel {spec.name!r}")

        context = zmq.Context.instance()
        self._router = context.socket(zmq.ROUTER)
        self._router.setsockopt(zmq.ROUTER_MANDATORY, 1)
        self._router.setsockopt(zmq.LINGER, 0)
        # Credits bound what a consumer is sent, so no high-water mark: a send (from a `put` too, which may run in an
        # event loop) never waits, and never fails for a full pipe, which would cost the consumer its credit.
        self._router.setsockopt(zmq.SNDHWM, 0)
        # Frames below this are copied into the message; larger ones are sent from their buffer, which costs a
        # round trip through pyzmq's garbage-collector thread per frame (it learns when libzmq is done with the
        # buffer): a copy of a few hundred KiB is cheaper than that hand-off on a busy host.
        self._router.copy_threshold = COPY_THRESHOLD
        self._door = gate.guard(self._router, spec.name, spec.key, spec.encrypt, self.id)  # (before it binds)
        ipc, tcp = wire.bind(self._router, ray.util.get_node_ip_address(), spec.name)
        self._router_fd = self._router.getsockopt(zmq.FD)
        self._bell = Doorbell()  # wakes the I/O thread
        self.record = ProducerRecord(
            id=self.id,
            node_id=ray.get_runtime_context().get_node_id(),
            ipc=ipc,
            tcp=tcp,
            arena=self._arena.record if self._arena is not None else None,
        )
        # A one-time registration, often from an async worker's event loop: waited on through the reference's
        # future (Ray's blocking get would warn on every run that the loop is blocked, here on purpose).
        registry().add_producer.remote(spec.name, self.record).future().result()
        self._thread = threading.Thread(target=self._run, name=f"channel-{spec.name}-producer", daemon=True)
        self._thread.start()
        track_end(self)

    # --- app side -------------------------------------------------------------------------------------------
    def _wake(self) -> None:
        self._bell.ring()

    def _raise_error(self) -> None:
        """Raise what ended this end's I/O, if anything did (Ray going away: ChannelClosed)."""
        if isinstance(self._error, ChannelClosed):
            raise ChannelClosed(str(self._error))
        if self._error is not None:
            raise ChannelPeerError(f"channel {self.spec.name!r}: producer I/O failed: {self._error}")

    def _check(self) -> None:
        self._raise_error()
        if self._stopping:
            raise ChannelClosed(f"channel {self.spec.name!r}: this process's end was aborted")
        if self._closing:
            raise ChannelClosed(f"channel {self.spec.name!r}: put() after close()")

    def _no_live_consumer(self) -> str | None:
        """Why nothing can drain this producer: every consumer that connected has died."""
        if self._consumers and all(c.dead for c in self._consumers.values()):
            dead = ", ".join(f"{cid.decode()} ({c.dead})" for cid, c in self._consumers.items())
            return f"channel {self.spec.name!r}: every consumer is gone: {dead}"
        return None

    def try_put(self, frames: list[Any], weight: float) -> Any:
        self._check()
        maxsize = self.spec.maxsize
        if maxsize is not None and self._untaken and self._untaken + weight > maxsize:
            problem = self._no_live_consumer()
            if problem:
                raise ChannelPeerError(problem + "; put() would block forever")
            return PENDING
        self._seq += 1
        # (len is the byte count: the codec's frames are bytes and flat uint8 arrays)
        self._queue.append(OutItem(self._seq, self._step, weight, frames[0], frames[1:], sum(map(len, frames))))
        self._outstanding[self._step] = self._outstanding.get(self._step, 0) + 1
        self._untaken += weight
        self._step_has_items = True
        if self._credits:  # a consumer can take it now
            if self._queue[-1].nbytes >= DIRECT_BYTES:
                self._send_now()  # from this thread: no hand-off to the I/O thread
            else:
                self._wake()  # the I/O thread sends what gathered meanwhile in one message
        return None  # (otherwise the I/O thread sends it when credit arrives)

    def _send_now(self) -> None:
        """The I/O thread's work, from the app's thread (under the lock). Anything raised here ends this end: a
        signal's handler (Ctrl-C, `RunStopped`) may raise between two frames of a message, and nothing may be sent
        after half a message (it would be glued to it), so the I/O thread stops before touching the router again.
        Socket and protocol failures become a ChannelPeerError; anything else (the signal's) is raised as is."""
        try:
            if self._pump():
                self._waiter.notify()
        except BaseException as exc:
            self._error = exc
            self._wake()
            if isinstance(exc, (zmq.ZMQError, msgspec.DecodeError)):
                raise ChannelPeerError(f"channel {self.spec.name!r}: producer I/O failed: {exc}") from exc
            raise

    def end_step(self) -> None:
        with self._waiter.lock:
            self._check()
            self._end_step()

    def _end_step(self) -> None:
        self._ended.append(self._step)
        self._step += 1
        self._step_has_items = False
        self._wake()

    def begin_close(self) -> None:
        with self._waiter.lock:
            if self._closing:
                return
            if self._step_has_items:
                self._end_step()
            self._closing = True
            self._wake()

    def try_finish_close(self) -> Any:
        self._raise_error()
        if self._closed:
            return None
        problem = self._no_live_consumer()
        if problem and self._untaken:
            raise ChannelPeerError(problem + f"; {len(self._queue)} item(s) cannot be delivered")
        return PENDING

    def untaken(self) -> tuple[int, float]:
        with self._waiter.lock:
            sent = sum(not item.taken for c in self._consumers.values() for item in c.inflight.values())
            return len(self._queue) + sent, self._untaken

    def shared_memory(self) -> tuple[int, int]:
        """Bytes of the arena that consumers hold (items sent and not yet released), and bytes of large buffers
        for consumers on this node that went over the socket because it was full."""
        with self._waiter.lock:
            if self._arena is None:
                return 0, 0
            return self._arena.allocator.used_bytes, self._arena.overflow_bytes

    # --- I/O thread -----------------------------------------------------------------------------------------
    def _run(self) -> None:
        # The router's zmq.FD and the doorbell, polled by the OS (zmq.Poller costs several microseconds a call in
        # Python). The FD only signals changes, so every pass ends by receiving until nothing is left (`ready.py`).
        poller = select.poll()
        poller.register(self._bell.rx, select.POLLIN)
        poller.register(self._router_fd, select.POLLIN)
        next_housekeeping = 0.0
        try:
            while ray.is_initialized():  # Ray gone (shutdown): nothing left to serve
                woken = poller.poll(self.spec.heartbeat_s * 1000 / 2)
                with self._waiter.lock:
                    if self._error is not None or self._stopping:  # (both ring: `stop`, a put's failed send)
                        break
                    self._bell.clear()
                    arrived = self._receive()
                    now = time.monotonic()
                    if now >= next_housekeeping:  # heartbeats and peer expiry, a few times per heartbeat
                        self._expire_consumers(now)
                        self._broadcast(wire.HEARTBEAT)
                        next_housekeeping = now + self.spec.heartbeat_s / 2
                    arrived = self._pump() or arrived
                    if self._closing and not self._closed and self._drained():
                        self._broadcast(wire.CLOSED, wire.pack(self._ended_through))
                        self._closed = True
                        self._waiter.notify()
                        break
                    if woken or arrived:
                        self._waiter.notify()
        except BaseException as exc:
            log.error("channel %r: %s I/O thread failed", self.spec.name, "producer", exc_info=True)
            with self._waiter.lock:
                self._error = exc
                self._waiter.notify()
        finally:
            self._shutdown_sockets()

    def _pump(self) -> bool:
        """Send what the credits allow and the step ends due, and handle what arrived, until nothing more arrives
        (the sends may have taken the router descriptor's signal: see `ready.py`); whether anything arrived."""
        arrived = False
        while True:
            self._dispatch()
            self._broadcast_markers()
            if not self._receive():
                return arrived
            arrived = True

    def _receive(self) -> bool:
        """Handle every message waiting on the router; whether any was there."""
        arrived = False
        for frames in wire.waiting(self._router):
            self._on_message(frames)
            arrived = True
        return arrived

    def _drained(self) -> bool:
        return not self._queue and not self._ended and not any(c.inflight for c in self._consumers.values())

    def _on_message(self, frames: list[Any]) -> None:
        cid, kind = frames[0].bytes, frames[1].bytes
        link = self._consumers.get(cid)
        if kind == wire.HELLO:
            if link is None or link.dead:
                link = self._consumers[cid] = ConsumerLink(time.monotonic())
            credit, reader, nonce = wire.unpack(frames[2].buffer)
            link.arena = self._arena if reader else None
            # (a reader this process cannot see in /proc, e.g. another pid namespace, is never taken for gone)
            link.reader = tuple(reader) if reader and process_start(reader[0]) == reader[1] else None
            self._credits.extend([cid] * credit)
            proof = gate.proof(self.spec.key, self.id, cid, nonce)  # (its first message: `wire.py`)
            self._send(cid, wire.STATE, wire.pack([self._ended_through, self._closed, proof]))
            return
        if kind == wire.BYE:  # (answered even when given up: the consumer waits for the answer, not its content)
            if link is not None and not link.dead:  # its buffer's items were never handed out: their regions are free
                self._drop(cid, link, "closed its end", reclaim=True)
            self._send(cid, wire.BYE)
            return
        if link is None or link.dead:
            return  # a consumer we gave up on; it will see itself dropped by our silence
        link.last_seen = time.monotonic()
        if kind == wire.CREDIT:
            taken, delivered, released, extra = wire.unpack(frames[2].buffer)
            link.release(released)  # no array of the consumer views these regions any more
            self._credits.extend([cid] * (len(taken) + extra))
            for seq in taken:  # out of the consumer's buffer: capacity is free and the step is nearer its end
                item = link.inflight.get(seq)
                if item is not None and not item.taken:
                    item.taken = True
                    self._untaken -= item.weight
                    self._outstanding[item.step] -= 1
            for seq in delivered:  # in the app's hands: the copy kept for redelivery can go
                link.inflight.pop(seq, None)

    def _expire_consumers(self, now: float) -> None:
        """Give up consumers silent for `peer_timeout_s`, and free the regions of given-up ones whose process is
        gone (one that is merely silent may still read them)."""
        for cid, link in list(self._consumers.items()):
            if not link.dead and now - link.last_seen > self.spec.peer_timeout_s:
                self._drop(cid, link, f"stopped responding (no message for {now - link.last_seen:.1f} s)")
            if link.dead and link.held:
                freed = link.free_if_gone()
                if freed:
                    log.info("channel %r: consumer %s exited; the %d bytes of shared memory it held are free again",
                             self.spec.name, cid.decode(), freed)

    def _drop(self, cid: bytes, link: ConsumerLink, why: str, reclaim: bool = False) -> None:
        """Forget a consumer; every item it did not hand to its app goes back to the front of the queue, in
        order. (An item it had already taken counts as outstanding again; if its step's end was already
        announced, the item reaches another consumer after that announcement.) The arena regions of those items
        are freed if it left cleanly (`reclaim`); one that stopped answering may still read them, so they stay
        its own, as do the regions of items it handed out, until its process is gone (`_expire_consumers`)."""
        link.dead = why
        for item in sorted(link.inflight.values(), key=lambda i: i.seq, reverse=True):
            link.forget_regions(item, free=reclaim)
            if item.taken:
                item.taken = False
                self._untaken += item.weight
                self._outstanding[item.step] = self._outstanding.get(item.step, 0) + 1
            self._queue.appendleft(item)
        link.inflight.clear()
        self._credits = deque(c for c in self._credits if c != cid)

    def _dispatch(self) -> None:
        """Send queued items along the credits, in order (`dispatch.next_message`)."""
        waiting: list[bytes] = []  # credits of consumers waiting for room in the arena, in their order
        while message := next_message(self._queue, self._credits, self._consumers, waiting):
            if self._send(message.cid, wire.ITEM, wire.pack(message.metas), *message.frames, unsent=message.items):
                self._consumers[message.cid].inflight.update((item.seq, item) for item in message.items)
        self._credits.extendleft(reversed(waiting))

    def _broadcast_markers(self) -> None:
        while self._ended and not self._outstanding.get(self._ended[0], 0):
            step = self._ended.popleft()
            self._outstanding.pop(step, None)
            self._ended_through = step
            self._broadcast(wire.STEP_END, wire.pack(step))

    def _broadcast(self, kind: bytes, *payload: Any) -> None:
        for cid, link in list(self._consumers.items()):
            if not link.dead:
                self._send(cid, kind, *payload)

    def _send(self, cid: bytes, kind: bytes, *payload: Any, unsent: Sequence[OutItem] = ()) -> bool:
        """Send one message to one consumer; False if it was not sent. The items of a message not sent (`unsent`)
        go back to the front of the queue first, then a consumer found disconnected is dropped (its unacknowledged
        items, sent earlier, go in front of them: order is kept)."""
        try:
            wire.send(self._router, [cid, kind, *payload], wire.NOBLOCK)  # (never blocks the app's thread)
            return True
        except zmq.Again:  # (not with SNDHWM 0; kept in case libzmq refuses anyway: expiry decides)
            self._requeue(cid, unsent)
            return False
        except zmq.ZMQError as exc:
            if exc.errno != zmq.EHOSTUNREACH:
                raise
            self._requeue(cid, unsent)
            link = self._consumers.get(cid)
            if link is not None and not link.dead:
                self._drop(cid, link, "disconnected")
            return False

    def _requeue(self, cid: bytes, unsent: Sequence[OutItem]) -> None:
        """Items of a message that was not sent go back to the front of the queue (their regions are free)."""
        for item in unsent:  # (an item message goes to a consumer this producer knows)
            self._consumers[cid].forget_regions(item, free=True)
        self._queue.extendleft(reversed(unsent))

    def _shutdown_sockets(self) -> None:
        with self._waiter.lock:  # (a put may be sending)
            self._router.close(linger=0)
            gate.retire(self._door)
            if self._arena is not None:
                self._arena.close()
            if not (self._closed or self._stopping or self._error):  # the loop ended because Ray did
                self._error = ChannelClosed(f"channel {self.spec.name!r}: Ray shut down under this process")
            self._waiter.notify()
            failure = self._failure()
        wire.unbind(self.record.ipc)
        if ray.is_initialized():  # (consumers that connect later must not take a failure for a clean end)
            registry().close_producer.remote(self.spec.name, self.id, self._ended_through, failure)

    def _failure(self) -> str | None:
        """Why this end stops short: it failed, or was aborted while items it put were not taken (None: it closed,
        or was aborted with nothing lost). Call with the lock held."""
        if self._closed:
            return None
        untaken = sum(self._outstanding.values())  # (queued, sent, or cut off in the middle of a send)
        if self._error is None and not untaken:
            return None
        cause = f"failed ({self._error})" if self._error is not None else "was aborted"
        return f"{cause} with {untaken} item(s) not taken"

    def stop(self) -> None:
        """Idempotent. Tear down without draining (process exit, abort)."""
        with self._waiter.lock:
            if self._stopping:
                return
            self._closing = self._stopping = True
            self._wake()
            self._waiter.notify()  # a put waiting here for credit raises ChannelClosed at once
        self._thread.join(timeout=5)
        self._bell.close()
