"""A consuming end's link to one producer: one connection, opened with the run's credentials (`gate.py`), on which
nothing is heard before the producer proved the run's channel key."""

from __future__ import annotations

import hmac
import logging
import os
import time
from dataclasses import dataclass, field
from typing import Any

import zmq

from rlinf_pipe.channels import gate, wire
from rlinf_pipe.channels.registry import ChannelSpec, ProducerRecord

log = logging.getLogger(__name__)


@dataclass
class ProducerLink:
    record: ProducerRecord
    sock: zmq.Socket
    fd: int  # the socket's zmq.FD, which waits poll
    endpoint: str
    last_seen: float
    proof: bytes | None = field(repr=False)  # what its first message must carry (None once it proved the key)
    unproven: int = 0  # messages ignored before that

    @classmethod
    def connect(cls, spec: ChannelSpec, consumer_id: str, record: ProducerRecord, local: bool,
                reader: Any) -> "ProducerLink":
        """Connect to the producer (over ipc if `local`, else tcp) and say hello: this consumer's credit, the
        `reader` that mapped the producer's arena (or None), and a fresh nonce the producer must answer."""
        sock = zmq.Context.instance().socket(zmq.DEALER)
        sock.setsockopt(zmq.ROUTING_ID, consumer_id.encode())
        sock.setsockopt(zmq.LINGER, 0)
        # One connection per producer: once it drops, whoever listens at that address next (a process that took a
        # dead producer's port or name) is never connected to. Sends never wait (`send`): no high-water mark.
        sock.setsockopt(zmq.RECONNECT_IVL, -1)
        sock.setsockopt(zmq.SNDHWM, 0)
        gate.present(sock, spec.name, spec.key, spec.encrypt, record.id)
        endpoint = record.ipc if local else record.tcp
        sock.connect(endpoint)
        nonce = os.urandom(16)
        proof = gate.proof(spec.key, record.id, consumer_id.encode(), nonce)
        link = cls(record, sock, sock.getsockopt(zmq.FD), endpoint, time.monotonic(), proof)
        link.send([wire.HELLO, wire.pack([spec.prefetch, reader, nonce])])
        return link

    def send(self, frames: list[Any]) -> None:
        """Send without waiting. With no high-water mark a send fails only when the producer's connection is gone
        (it is not made again) or was refused; the producer then ignores this consumer anyway, and expiry or the
        registry will say what became of it."""
        try:
            wire.send(self.sock, frames, wire.NOBLOCK)
        except zmq.Again:
            pass

    def proves_key(self, channel: str, frames: list[Any]) -> bool:
        """Whether this first message is the STATE that proves the run's key for our hello's nonce (then the
        producer is heard from now on). Anything else is ignored, and logged once: the process at that address is
        not the registered producer (it may have taken the address of one that exited)."""
        try:
            proven = frames[0].bytes == wire.STATE and hmac.compare_digest(wire.unpack(frames[1].buffer)[2], self.proof)
        except Exception:  # noqa: BLE001 - whatever a stranger sent
            proven = False
        if proven:
            self.proof = None
        elif not self.unproven:
            log.warning("channel %r: ignoring what %s sends: it did not prove this run's channel key, so it is not the "
                        "producer %s registered (another process took its address?)", channel, self.endpoint,
                        self.record.id)
        self.unproven += not proven
        return proven


def await_goodbyes(channel: str, links: dict[str, ProducerLink], timeout_s: float) -> list[str]:
    """Wait at most `timeout_s` for each producer of `links`, sent BYE, to answer BYE (or say it closed): then
    everything sent to it before (the last takes) reached it, and no item taken here goes to another consumer. What
    else arrives meanwhile is dropped (the producer sends those items again). Returns the producers that did not
    answer."""
    poller = zmq.Poller()
    by_sock: dict[zmq.Socket, str] = {}
    for producer, link in links.items():
        poller.register(link.sock, zmq.POLLIN)
        by_sock[link.sock] = producer
    deadline = time.monotonic() + timeout_s
    while by_sock and (left_s := deadline - time.monotonic()) > 0:
        for sock, _ in poller.poll(left_s * 1000):
            link = links[by_sock[sock]]
            for frames in wire.waiting(sock):
                if link.proof is not None:  # (its STATE may come first, or a stranger's words)
                    link.proves_key(channel, frames)
                elif frames[0].bytes in (wire.BYE, wire.CLOSED) and sock in by_sock:  # (closed: it had them all)
                    poller.unregister(sock)
                    del by_sock[sock]
    return list(by_sock.values())
