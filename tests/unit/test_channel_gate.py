"""`gate.py`: a producing end's socket lets in only peers that prove the run's channel key (real ZeroMQ sockets and
the process's real ZAP handler; no Ray)."""

from __future__ import annotations

import logging
import os
import uuid
from collections.abc import Iterator

import msgspec
import pytest
import zmq
from zmq.utils.monitor import recv_monitor_message

from rlinf_pipe.errors import ChannelError
from rlinf_pipe.channels import gate
from rlinf_pipe.channels.registry import ChannelSpec

FAILED = zmq.EVENT_HANDSHAKE_FAILED_AUTH | zmq.EVENT_HANDSHAKE_FAILED_PROTOCOL | zmq.EVENT_HANDSHAKE_FAILED_NO_DETAIL
PRODUCER = "producer@test:1:abcdef"


@pytest.fixture(params=[False, True], ids=["plain", "curve"])
def server(request) -> Iterator[tuple[zmq.Socket, gate.Door, gate.ChannelKey, bool, list[str]]]:
    """A guarded ROUTER (as a producing end's) on tcp and ipc, and its addresses."""
    encrypt, key = request.param, gate.ChannelKey.new()
    router = zmq.Context.instance().socket(zmq.ROUTER)
    door = gate.guard(router, "gated", key, encrypt, PRODUCER)
    local = f"ipc://@rlp-test-{uuid.uuid4().hex[:12]}"
    router.bind(local)
    port = router.bind_to_random_port("tcp://127.0.0.1")
    yield router, door, key, encrypt, [f"tcp://127.0.0.1:{port}", local]
    gate.retire(door)
    router.close(linger=0)


def _client(context: zmq.Context, endpoint: str, setup=None) -> tuple[zmq.Socket, zmq.Socket]:
    """A DEALER that connects to `endpoint` and says hello at once, and its monitor."""
    sock = context.socket(zmq.DEALER)
    sock.linger = 0
    if setup is not None:
        setup(sock)
    monitor = sock.get_monitor_socket()
    sock.connect(endpoint)
    try:
        sock.send(b"hello", zmq.NOBLOCK)
    except zmq.Again:  # refused already (libzmq drops a refused connection's pipe: a blocking send would wait)
        pass
    return sock, monitor


def _handshake_outcome(monitor: zmq.Socket) -> int:
    """The first handshake event of a client: succeeded, or failed (which way)."""
    while monitor.poll(30_000):
        event = recv_monitor_message(monitor)["event"]
        if event & (FAILED | zmq.EVENT_HANDSHAKE_SUCCEEDED):
            return event
    raise AssertionError("no handshake outcome within 30 s")


def test_only_a_peer_with_the_key_gets_in_and_each_refused_address_is_logged_once(server, caplog):
    router, door, key, encrypt, endpoints = server
    stranger_context = zmq.Context()  # (another process's, as far as ZeroMQ is concerned)

    def wrong_credentials(sock: zmq.Socket) -> None:
        if encrypt:  # the producers' public key (no secret, in general) and a key pair of its own
            sock.curve_serverkey = gate.curve_keys(key)[0]
            sock.curve_publickey, sock.curve_secretkey = zmq.curve_keypair()
        else:  # another run's
            gate.present(sock, "gated", gate.ChannelKey.new(), encrypt, PRODUCER)

    def no_credentials(sock: zmq.Socket) -> None:
        pass

    strangers = []
    with caplog.at_level(logging.WARNING, logger=gate.__name__):
        for endpoint in endpoints:
            for setup in (no_credentials, wrong_credentials, wrong_credentials):
                sock, monitor = _client(stranger_context, endpoint, setup)
                assert _handshake_outcome(monitor) & FAILED, endpoint
                strangers.append((sock, monitor))
        assert not router.poll(0)  # nothing of theirs reached the socket
        # (a peer without credentials is turned away at the greeting: the handler never hears of it)
        local = f"a local process (pid {os.getpid()}, uid {os.getuid()})"
        assert door.refused == ["127.0.0.1", local]
        refusals = [r.getMessage() for r in caplog.records]
        assert len(refusals) == 2 and "refused a connection from 127.0.0.1" in refusals[0] and local in refusals[1]

        for endpoint in endpoints:
            sock, monitor = _client(stranger_context, endpoint, lambda s: gate.present(s, "gated", key, encrypt, PRODUCER))
            assert _handshake_outcome(monitor) == zmq.EVENT_HANDSHAKE_SUCCEEDED
            assert router.poll(30_000) and router.recv_multipart()[1] == b"hello"
            strangers.append((sock, monitor))
    assert len(caplog.records) == 2
    for sock, monitor in strangers:
        sock.disable_monitor()
        monitor.close(linger=0)
        sock.close(linger=0)
    stranger_context.term()


@pytest.mark.parametrize("server", [False], ids=["plain"], indirect=True)  # (CURVE shows a server no secret)
def test_the_password_of_one_producer_opens_no_other(server):
    """A process that took a dead producer's address learns that producer's password from the consumers that still
    connect there: it must not open a live producer's socket."""
    router, door, key, encrypt, endpoints = server
    context = zmq.Context()

    def a_dead_producers_password(sock: zmq.Socket) -> None:
        sock.plain_username, sock.plain_password = gate.USERNAME, gate.password(key, "producer@test:2:dead00")

    sock, monitor = _client(context, endpoints[0], a_dead_producers_password)
    assert _handshake_outcome(monitor) & FAILED
    sock.disable_monitor()
    monitor.close(linger=0)
    sock.close(linger=0)
    context.term()


def test_the_key_never_shows_in_a_spec_printed_and_a_spec_without_one_is_refused():
    key = gate.ChannelKey.new()
    spec = ChannelSpec(name="printed", key=key)
    assert key.secret.hex() not in repr(spec) and "<secret>" in repr(spec)
    assert msgspec.msgpack.decode(msgspec.msgpack.encode(spec), type=ChannelSpec) == spec  # (it still travels)
    sock = zmq.Context.instance().socket(zmq.ROUTER)
    try:
        with pytest.raises(ChannelError, match="'handmade' has no channel key: create it with Channel.create"):
            gate.guard(sock, "handmade", None, False, PRODUCER)
        with pytest.raises(ChannelError, match="'handmade' has no channel key"):
            gate.present(sock, "handmade", None, False, PRODUCER)
    finally:
        sock.close(linger=0)


def test_proofs_differ_by_key_producer_consumer_and_nonce():
    key, nonce = gate.ChannelKey.new(), os.urandom(16)
    proof = gate.proof(key, PRODUCER, b"consumer@a", nonce)
    assert proof == gate.proof(key, PRODUCER, b"consumer@a", nonce)
    assert len({proof, gate.proof(gate.ChannelKey.new(), PRODUCER, b"consumer@a", nonce),
                gate.proof(key, "producer@other", b"consumer@a", nonce), gate.proof(key, PRODUCER, b"consumer@b", nonce),
                gate.proof(key, PRODUCER, b"consumer@a", os.urandom(16))}) == 5
