"""The consuming end of a socket channel in one process.

Connects to every producer of the channel (ipc on the same node, tcp otherwise) and grants each `prefetch` items
of credit. The app receives what arrived in its own thread or event loop when it takes (`take`, under the
waiter's lock; waits sleep on the sockets, see `ready.py`): libzmq holds what was sent meanwhile, and no thread
stands between the socket and the app. Each take returns one credit to that item's producer (so a slow consumer is
sent less) and is acknowledged so the producer can forget the item. A housekeeping thread discovers producers
through the registry, sends heartbeats, watches the producers' (receiving what waits, so a busy app does not make
a producer look silent) and reports takes the app left unreported. Large buffers from a producer on this node
arrive in its shared memory (`arena.py`); their regions are reported released with the takes. A producer is heard
only once it proved the run's channel key, and the consumer proves it to the producer (`gate.py`).
"""

from __future__ import annotations

import logging
import threading
import time
from concurrent.futures import Future
from typing import Any, Callable

import ray
import zmq

from rlinf_pipe.errors import ChannelClosed, ChannelPeerError
from rlinf_pipe.channels import wire
from rlinf_pipe.channels.arena import ArenaView, this_process
from rlinf_pipe.channels.buffer import Entry, StepBuffer
from rlinf_pipe.channels.ready import Doorbell, SocketWaiter
from rlinf_pipe.channels.registry import ChannelSpec, ProducerRecord, registry, track_end
from rlinf_pipe.utils.worker_death import GONE
from rlinf_pipe.channels.upstream import ProducerLink, await_goodbyes
from rlinf_pipe.channels.wire import endpoint_id

REFRESH_S = 1.0  # how often the registry is asked for new producers
EAGER_REFRESH_S = 0.02  # ... while producers are still missing
ANSWER_POLL_S = 0.01  # how often the housekeeping thread looks for the registry's answer meanwhile
REPORT_DELAY_S = 0.005  # takes the app left unreported go out this long after the first of them
STREAMING_S = 0.05  # while the app took an item this recently, the housekeeping thread wakes every ...
STREAMING_WAKE_S = 0.02  # ... this often (a take rings it only when it would report later than this past due)
LEAVE_WAIT_S = 2.0  # how long a leaving consumer waits for each producer to confirm it heard the last takes
log = logging.getLogger(__name__)


class ConsumerEnd:
    """Connects to every producer of the channel; the app receives their items when it takes. Every use of the
    sockets holds the waiter's lock and ends by receiving until none is left (see `ready.py`)."""

    def __init__(self, spec: ChannelSpec):
        self.spec = spec
        self.id = endpoint_id("consumer")
        self._waiter = SocketWaiter(threading.RLock(), self._socket_fds)
        self.buffer = StepBuffer(spec.name, expected_producers=spec.num_producers)
        self._links: dict[str, ProducerLink] = {}
        self._fds: tuple[int, ...] = ()
        self._arenas: dict[str, ArenaView] = {}  # producer -> its arena, where mapped
        self._extra_credit: dict[str, int] = {}  # producer -> the step for which it was granted one more credit
        self._handed: dict[str, list[int]] = {}  # producer -> seqs handed to the app, not yet reported
        self._handed_weight: dict[str, float] = {}  # producer -> their weight
        # Takes are reported together (fewer wake-ups on both ends), at the latest once half of `prefetch` of them,
        # or a quarter of the producer's `maxsize` in weight, wait: a producer blocked at `maxsize` (a few heavy
        # items) is released before this consumer's buffer runs dry.
        self._report_batch = max(1, spec.prefetch // 2)
        self._report_weight = spec.maxsize / 4 if spec.maxsize is not None else float("inf")
        self._report_due: float | None = None  # when takes not yet reported are due
        self._sleeps_until = 0.0  # when the housekeeping thread's current wait ends
        self._last_take = 0.0
        self._node_id = ray.get_runtime_context().get_node_id()
        self._registry = registry()
        self._ray_alive: Callable[[], bool] = ray.is_initialized  # (a test stands in for Ray going away)
        self._stopping = False
        self._confirm_leave = False  # (`stop`)
        self._error: BaseException | None = None
        self._bell = Doorbell()  # wakes the housekeeping thread (to stop)
        self._refresh()
        self._thread = threading.Thread(target=self._run, name=f"channel-{spec.name}-consumer", daemon=True)
        self._thread.start()
        track_end(self)

    # --- app side (call with the waiter lock held) ----------------------------------------------------------
    def check(self) -> None:
        if isinstance(self._error, ChannelClosed):
            raise ChannelClosed(str(self._error))
        if self._error is not None:
            raise ChannelPeerError(f"channel {self.spec.name!r}: consumer I/O failed: {self._error}")
        if self._stopping:
            raise ChannelClosed(f"channel {self.spec.name!r}: this process's end was closed or aborted")

    def take(self) -> Entry | None:
        """The oldest entry of the current step, handed to the app, or None if none has arrived. Receives first
        when the buffer has none (and, about to find nothing, reports the takes not yet reported: a step's end may
        hang on them)."""
        entry = self.buffer.pop()
        if entry is None:
            if self._handed or self._releases_wait():
                self._flush_updates()
            self.receive()
            entry = self.buffer.pop()
            if entry is None and self.buffer.count:
                self._credit_for_current_step()
        if entry is not None:
            self._hand_over(entry)
        return entry

    def _credit_for_current_step(self) -> None:
        """The buffer holds only later steps' items. If they use up a producer's credit, an item of the current step
        that this producer sends again (another consumer died holding it) could reach no consumer, and the step
        would never end: the producer is granted one more credit, once per step."""
        held: dict[str, int] = {}
        for queue in self.buffer.by_step.values():
            for entry in queue:
                held[entry.producer] = held.get(entry.producer, 0) + 1
        for producer, count in held.items():
            if count < self.spec.prefetch or self._extra_credit.get(producer) == self.buffer.step:
                continue
            link = self._links.get(producer)
            if link is None or self.buffer.producer(producer).gone:
                continue
            self._extra_credit[producer] = self.buffer.step
            link.send([wire.CREDIT, wire.pack([[], [], [], 1])])
            self.receive()  # (after a send: see `ready.py`)

    def _hand_over(self, entry: Entry) -> None:
        """An entry was taken out of the buffer and handed to the app: its producer gets one more credit, frees the
        capacity, counts it toward the end of its step, and may drop the copy kept for redelivery. Takes are
        reported together: once half of `prefetch` of them (or a quarter of `maxsize` in weight) wait, when the app
        finds nothing more to take, else by the housekeeping thread `REPORT_DELAY_S` after the first of them (or,
        while items flow, at its next wake-up, every `STREAMING_WAKE_S`; a take after a quiet spell rings it)."""
        self._last_take = time.monotonic()
        handed = self._handed.setdefault(entry.producer, [])
        handed.append(entry.seq)
        weight = self._handed_weight[entry.producer] = self._handed_weight.get(entry.producer, 0.0) + entry.weight
        arena = self._arenas.get(entry.producer) if self._arenas else None
        if (
            len(handed) >= self._report_batch
            or weight >= self._report_weight  # the producer may be running short of capacity
            or (arena is not None and arena.released and arena.filling())  # ... or of shared memory
        ):
            self._flush_updates()
            self.receive()  # (the send may have taken a socket's signal: see `ready.py`)
        elif self._report_due is None:
            self._report_due = self._last_take + REPORT_DELAY_S
            if self._sleeps_until > self._report_due + STREAMING_WAKE_S:  # asleep since before the stream
                self._bell.ring()

    def _releases_wait(self) -> bool:
        for arena in self._arenas.values():
            if arena.released:
                return True
        return False

    def _socket_fds(self) -> tuple[int, ...]:
        return self._fds

    def endpoints(self) -> list[str]:
        """The producer addresses this consumer connected to (ipc on its node, tcp across nodes)."""
        with self._waiter.lock:
            return [link.endpoint for link in self._links.values()]

    # --- I/O thread -----------------------------------------------------------------------------------------
    def _refresh(self) -> None:
        """Connect to the producers the registry knows, waiting for its answer (the first look, from the app's
        thread; the housekeeping thread asks without waiting: `_ask_registry`)."""
        self._apply(self._ask_registry())

    def _ask_registry(self) -> Future:
        """The registry's producers of this channel, to come. Through the reference's future, not ray.get: a
        blocking ray.get from the housekeeping thread, which runs no Ray task, crashed consumer processes with
        SIGSEGV inside Ray's task metrics (CoreWorker::Get -> TaskCounter::UnsetMetricStatus) in
        benchmarks/channel_bench.py."""
        return self._registry.list_producers.remote(self.spec.name).future()

    def _apply(self, answer: Future) -> None:
        """With the registry's `answer` (done): connect to producers that registered since the last look, and learn
        which ones ended."""
        try:
            records = answer.result()
        except GONE:  # the job that owned the registry ended (or Ray's memory monitor killed it): so does this channel
            self._stopping = True
            return
        with self._waiter.lock:
            for record in records:
                if record.id not in self._links:
                    self._connect(record)
                self._note_end(record)
            self.receive()
            self._waiter.notify()  # (waits poll the new sockets too)

    def _connect(self, record: ProducerRecord) -> None:
        local = record.node_id == self._node_id
        arena = ArenaView.open(record.arena) if local and record.arena is not None else None
        reader = this_process() if arena is not None else None  # (the producer frees its regions once it is gone)
        if reader is None:
            arena = None  # (unmapped with its last reference)
        self._links[record.id] = ProducerLink.connect(self.spec, self.id, record, local, reader)
        if arena is not None:
            self._arenas[record.id] = arena
        self._fds = tuple(link.fd for link in self._links.values())

    def _note_end(self, record: ProducerRecord) -> None:
        """What the registry says of a producer's end. Closed: every item it put was taken, so this consumer owes
        it nothing and waits for nothing more from it (its socket may have closed before it read our hello, when we
        connected as it closed: it would never say so itself). Failed, or aborted with items not taken: dead to this
        consumer at once (it says nothing on its socket before going), and a step it did not end cannot complete."""
        state = self.buffer.producer(record.id)
        if record.closed and not state.closed:
            state.closed, state.ended_through = True, max(state.ended_through, record.ended_through)
            self._waiter.notify()
        elif record.failure is not None and not state.dead and not state.closed:
            state.ended_through = max(state.ended_through, record.ended_through)
            state.dead = record.failure
            self._waiter.notify()

    def _run(self) -> None:
        next_housekeeping = next_refresh = 0.0
        # The registry's answer, while one is awaited: heartbeats and peer expiry go on meanwhile (a registry slow
        # to answer for `peer_timeout_s` would otherwise have the producers give this consumer up).
        asked: Future | None = None
        try:
            while not self._stopping and self._ray_alive():  # Ray gone (shutdown): nothing left to serve
                with self._waiter.lock:  # (a take that sets `_report_due` rings if this wait would outlast it)
                    now = time.monotonic()
                    refresh_in = max(0.0, next_refresh - now) if asked is None else ANSWER_POLL_S
                    wait_s = min(self.spec.heartbeat_s / 2, refresh_in)
                    if self._report_due is not None:
                        wait_s = min(wait_s, max(0.0, self._report_due - now))
                    elif now - self._last_take < STREAMING_S:  # items flow: stay near, so that no take rings
                        wait_s = min(wait_s, STREAMING_WAKE_S)
                    self._sleeps_until = now + wait_s
                self._bell.wait(wait_s)
                now = time.monotonic()
                if asked is None and now >= next_refresh:
                    asked = self._ask_registry()
                if asked is not None and asked.done():
                    self._apply(asked)  # (the loop ends if the registry is gone)
                    asked = None
                    expected = self.spec.num_producers
                    missing = not self._links or (expected is not None and len(self._links) < expected)
                    next_refresh = now + (EAGER_REFRESH_S if missing else REFRESH_S)
                with self._waiter.lock:
                    self._bell.clear()
                    reported = self._report_due is not None and now >= self._report_due
                    if now >= next_housekeeping and self._releases_wait():  # (items the app dropped later)
                        reported = True
                    if reported:
                        self._flush_updates()
                    if now >= next_housekeeping:  # heartbeats and peer expiry, a few times per heartbeat
                        self._send_heartbeats()
                        self.receive()  # what waits (the app may be busy), and after the sends
                        self._expire_producers(now)
                        next_housekeeping = now + self.spec.heartbeat_s / 2
                    elif reported:
                        self.receive()  # (after a send: see `ready.py`; while items flow, the app receives)
        except BaseException as exc:
            log.error("channel %r: %s I/O thread failed", self.spec.name, "consumer", exc_info=True)
            with self._waiter.lock:
                self._error = exc
                self._waiter.notify()
        finally:
            self._close_sockets()

    def _send_heartbeats(self) -> None:
        """To every producer still alive, without waiting: one that died or froze stops taking messages, and a
        blocked send here would hold the lock (and every take) for good."""
        for producer, link in self._links.items():
            if self.buffer.producer(producer).gone:
                continue
            link.send([wire.HEARTBEAT])

    def receive(self) -> None:
        """Move every message waiting on the producer sockets into the buffer (call with the waiter lock held);
        wakes the other waiters if any arrived."""
        arrived = False
        for producer, link in self._links.items():
            for frames in wire.waiting(link.sock):
                self._on_message(producer, frames)
                arrived = True
        if arrived:
            self._waiter.notify()

    def _flush_updates(self) -> None:
        """One CREDIT message per producer carries everything handed over since the last (taken out of the buffer
        and delivered, which the wire protocol reports as two lists) and the arena regions released since."""
        handed = self._handed
        for producer, arena in self._arenas.items():  # (producers with regions released and no takes to report)
            if arena.released and producer not in handed:
                handed[producer] = []
        for producer, seqs in handed.items():
            link = self._links[producer]
            arena = self._arenas.get(producer)
            released = arena.take_released() if arena is not None and arena.released else []
            if released and not seqs and self.buffer.producer(producer).gone:
                continue  # (it needs them no more, and may not read)
            if seqs or released:
                try:
                    link.send([wire.CREDIT, wire.pack([seqs, seqs, released, 0])])
                except BaseException:
                    if released:  # (still this consumer's to report: the producer must not lose the regions)
                        arena.released.extendleft(reversed(released))
                    raise
        self._handed.clear()
        self._handed_weight.clear()
        self._report_due = None

    def _on_message(self, producer: str, frames: list[Any]) -> None:
        link = self._links[producer]
        if link.proof is not None and not link.proves_key(self.spec.name, frames):
            return
        link.last_seen = time.monotonic()
        kind = frames[0].bytes
        state = self.buffer.producer(producer)
        if kind == wire.ITEM:
            at = 2
            for seq, step, weight, header, placed in wire.unpack(frames[1].buffer):
                if placed.__class__ is int:  # (a count of frames)
                    payload = [header, *frames[at:at + placed]]
                    at += placed
                else:  # a place per buffer: the next frame, or a region of the producer's arena
                    payload = [header]
                    arena = self._arenas.get(producer)
                    for place in placed:
                        if place is None:
                            payload.append(frames[at])
                            at += 1
                        elif arena is None:
                            raise ChannelPeerError(f"producer {producer} sent shared memory this consumer never mapped")
                        else:
                            payload.append(arena.lease(*place))
                self.buffer.add(Entry(producer, seq, step, weight, payload))
        elif kind == wire.STEP_END:
            state.ended_through = max(state.ended_through, wire.unpack(frames[1].buffer))
        elif kind == wire.STATE:
            ended, closed, _proof = wire.unpack(frames[1].buffer)
            state.ended_through = max(state.ended_through, ended)
            state.closed = state.closed or closed
        elif kind == wire.CLOSED:
            state.ended_through = max(state.ended_through, wire.unpack(frames[1].buffer))
            state.closed = True

    def _expire_producers(self, now: float) -> None:
        for producer, link in self._links.items():
            state = self.buffer.producer(producer)
            silent = now - link.last_seen
            if not state.closed and not state.dead and silent > self.spec.peer_timeout_s:
                state.dead = f"stopped responding (no message for {silent:.1f} s)"
                self._waiter.notify()

    def _close_sockets(self) -> None:
        with self._waiter.lock:
            if not self._stopping and self._error is None:  # the loop ended because Ray did
                self._error = ChannelClosed(f"channel {self.spec.name!r}: Ray shut down under this process")
            self._flush_updates()  # takes not yet reported: the producers must not hand them to other consumers
            listening: dict[str, ProducerLink] = {}
            for producer, link in self._links.items():
                try:
                    link.sock.send(wire.BYE, zmq.NOBLOCK)
                except zmq.ZMQError:
                    continue
                if not self.buffer.producer(producer).gone:
                    listening[producer] = link
            if self._confirm_leave and self._error is None:
                self._await_goodbyes(listening)
            for link in self._links.values():
                link.sock.close(linger=100)  # (an abort does not wait: its BYE gets a moment to leave)
            self._arenas.clear()  # (each lease keeps the mapping it views)
            self._links.clear()  # (what the app asks afterwards finds no socket to read)
            self._fds = ()
            self._waiter.notify()

    def _await_goodbyes(self, listening: dict[str, ProducerLink]) -> None:
        """Wait until each producer still reading heard this consumer leave (closing a socket drops what it has
        not sent yet: an I/O thread starved for a moment would lose the last takes, and their items would reach
        another consumer too)."""
        wait_s = min(LEAVE_WAIT_S, self.spec.peer_timeout_s)
        for producer in await_goodbyes(self.spec.name, listening, wait_s):
            log.warning("channel %r: producer %s did not answer this consumer's leaving within %.1f s; the items "
                        "taken here since its last report may be sent again to another consumer",
                        self.spec.name, producer, wait_s)

    def stop(self, confirm: bool = False) -> None:
        """Idempotent. Leave the channel: producers hand this consumer's untaken items to the other consumers.
        With `confirm` (a close), wait until each producer heard it (at most `LEAVE_WAIT_S`); without (an abort,
        Ray shutting down), go at once."""
        with self._waiter.lock:
            if self._stopping:
                return
            self._stopping = True
            self._confirm_leave = confirm
            self._bell.ring()
            self._waiter.notify()  # a get waiting here raises ChannelClosed at once
        self._thread.join(timeout=5)
        self._bell.close()
