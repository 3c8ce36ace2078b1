"""`wire.send` / `wire.recv` (rlinf_pipe/channels/wire.py): multipart messages through pyzmq's Cython layer,
and through its Python layer where the backend is not Cython."""

from __future__ import annotations

import uuid

import numpy as np
import pytest
import zmq

from rlinf_pipe.channels import wire


@pytest.fixture
def pair():
    context = zmq.Context.instance()
    address = f"inproc://wire-{uuid.uuid4().hex}"
    a, b = context.socket(zmq.PAIR), context.socket(zmq.PAIR)
    a.bind(address)
    b.connect(address)
    a.copy_threshold = 1024  # small frames copied, the large one sent from its buffer
    yield a, b
    a.close(linger=0)
    b.close(linger=0)


@pytest.mark.parametrize("cython", [True, False], ids=["cython", "python-layer"])
def test_a_multipart_message_arrives_whole_and_in_order(pair, monkeypatch, cython):
    monkeypatch.setattr(wire, "_CYTHON", cython)
    a, b = pair
    big = np.arange(4096, dtype=np.uint8)
    wire.send(a, [wire.ITEM, wire.pack([1, b"header"]), b"", big])
    wire.send(a, [wire.HEARTBEAT])
    first, second = wire.recv(b, wire.NOBLOCK), wire.recv(b, wire.NOBLOCK)
    assert [f.bytes for f in first] == [wire.ITEM, wire.pack([1, b"header"]), b"", big.tobytes()]
    assert [f.bytes for f in second] == [wire.HEARTBEAT]
    with pytest.raises(zmq.Again):
        wire.recv(b, wire.NOBLOCK)


def test_a_router_refuses_an_unknown_peer_at_the_first_frame_and_stays_usable():
    """ROUTER_MANDATORY refuses an unroutable peer before any frame of the message is queued, so the next message,
    to a known peer, arrives whole."""
    context = zmq.Context.instance()
    address = f"inproc://wire-{uuid.uuid4().hex}"
    router, dealer = context.socket(zmq.ROUTER), context.socket(zmq.DEALER)
    router.setsockopt(zmq.ROUTER_MANDATORY, 1)
    dealer.setsockopt(zmq.ROUTING_ID, b"peer")
    try:
        router.bind(address)
        dealer.connect(address)
        wire.send(dealer, [wire.HELLO])
        assert router.poll(30_000) and [f.bytes for f in wire.recv(router)] == [b"peer", wire.HELLO]
        with pytest.raises(zmq.ZMQError) as refused:
            wire.send(router, [b"nobody", wire.ITEM, b"payload"])
        assert refused.value.errno == zmq.EHOSTUNREACH
        wire.send(router, [b"peer", wire.ITEM, b"payload"])
        assert dealer.poll(30_000) and [f.bytes for f in wire.recv(dealer)] == [wire.ITEM, b"payload"]
    finally:
        router.close(linger=0)
        dealer.close(linger=0)


def test_waiting_drains_every_message_and_the_next_one_wakes_the_descriptor(pair):
    """The rule `ready.py` relies on: after `waiting` (which stops when the socket's EVENTS show nothing to read), a
    poll of the socket's descriptor wakes for the next message. Stopping while a message still waited would leave
    the descriptor silent: libzmq signals it only when the socket's pipe becomes readable again."""
    import select

    a, b = pair
    for i in range(3):
        wire.send(a, [wire.HEARTBEAT, wire.pack(i)])
    assert b.poll(30_000)  # (the messages have arrived)
    assert [wire.unpack(frames[1].bytes) for frames in wire.waiting(b)] == [0, 1, 2]
    poller = select.poll()
    poller.register(b.getsockopt(zmq.FD), select.POLLIN)
    wire.send(a, [wire.HEARTBEAT, wire.pack(3)])
    assert poller.poll(10_000), "the descriptor stayed silent after a drain"
    assert [wire.unpack(frames[1].bytes) for frames in wire.waiting(b)] == [3]
