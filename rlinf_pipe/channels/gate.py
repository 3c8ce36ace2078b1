"""Who may talk on a channel: the run's own processes, which prove the run's channel key before anything else.

The registry, which the run's driver creates, makes one `ChannelKey` per run. Every channel's spec carries it to
the processes that use the channel, through Ray, whose own connections are authenticated.

- A producing end's socket is a ZeroMQ server of the PLAIN mechanism, or of CURVE where the spec says `encrypt`
  (encrypted, for networks the cluster does not trust). libzmq asks this process's ZAP handler about each
  handshake before it reads the peer's first message: one thread per process, on `inproc://zeromq.zap.01`.
  Nothing is checked per message. A consumer's PLAIN password is derived from the key and that producer's id,
  so a process that takes over a dead producer's address learns nothing it could use on a live one. A refused
  peer is logged once per address. (A peer that does not speak the mechanism at all is dropped by libzmq at the
  greeting, before any credential is read, and libzmq does not report its address.)
- A consuming end ignores a producer until the producer's first message proves the key for the fresh nonce of
  the consumer's hello (`proof`). Its socket never reconnects, so no other process can take the proven one's
  place.
"""

from __future__ import annotations

import hashlib
import hmac
import logging
import os
import threading
from dataclasses import dataclass, field

import msgspec
import zmq
from zmq.utils import z85

from rlinf_pipe.errors import ChannelError

ZAP_ENDPOINT = "inproc://zeromq.zap.01"  # (fixed by the ZAP protocol: one handler per ZeroMQ context)
USERNAME = b"rlinf-pipe"
log = logging.getLogger(__name__)


class ChannelKey(msgspec.Struct, frozen=True):
    """A run's channel secret. Its repr hides it: a spec may be printed in an error message or a log."""

    secret: bytes

    @classmethod
    def new(cls) -> "ChannelKey":
        return cls(os.urandom(32))

    def derive(self, *parts: bytes | str) -> bytes:
        """A 32-byte value only a holder of the key can compute from `parts`."""
        return hmac.new(self.secret, msgspec.msgpack.encode(parts), hashlib.sha256).digest()

    def __repr__(self) -> str:
        return "ChannelKey(<secret>)"


def password(key: ChannelKey, producer_id: str) -> bytes:
    return key.derive("password", producer_id)


def proof(key: ChannelKey, producer_id: str, consumer_id: bytes, nonce: bytes) -> bytes:
    """What a producer sends a consumer in reply to its hello: proves the key, for this pair and this nonce."""
    return key.derive("producer", producer_id, consumer_id, nonce)


def curve_keys(key: ChannelKey) -> tuple[bytes, bytes]:
    """The run's CURVE key pair (public, secret; Z85), derived from the channel key: producers serve with it and
    consumers present it, so both ends prove the key and nothing else needs to be handed out."""
    secret = z85.encode(key.derive("curve"))
    return zmq.curve_public(secret), secret


def _key_of(channel: str, key: ChannelKey | None, encrypt: bool) -> ChannelKey:
    if key is None:
        raise ChannelError(f"channel {channel!r} has no channel key: create it with Channel.create (the registry "
                           "hands out the run's key), and open it with Channel.open, not from a hand-made ChannelSpec")
    if encrypt and not zmq.has("curve"):
        raise ChannelError(f"channel {channel!r} asks for encryption, but this pyzmq was built without CURVE "
                           "(libsodium): install a pyzmq wheel from PyPI, or turn channel encryption off")
    return key


@dataclass
class Door:
    """One producing end's socket as the gate knows it: what a peer must present, and whom it turned away."""

    channel: str
    domain: bytes
    mechanism: bytes
    expected: bytes  # PLAIN: the password; CURVE: the client's public key (32 bytes)
    refused: list[str] = field(default_factory=list)  # addresses refused, each once
    gate: "_Gate | None" = field(default=None, repr=False)  # the handler it is registered with

    def admits(self, mechanism: bytes, credentials: list[bytes]) -> bool:
        return mechanism == self.mechanism and bool(credentials) and hmac.compare_digest(credentials[-1], self.expected)


class _Gate:
    """This process's ZAP handler: answers libzmq's question about every handshake on a guarded socket."""

    def __init__(self, context: zmq.Context):
        self.context, self.pid = context, os.getpid()
        self.doors: dict[bytes, Door] = {}
        self.lock = threading.Lock()
        self.sock = context.socket(zmq.REP)
        self.sock.linger = 0
        try:
            self.sock.bind(ZAP_ENDPOINT)
        except zmq.ZMQError as exc:
            self.sock.close()
            raise ChannelError(f"channel sockets need this process's ZeroMQ authentication handler, but "
                               f"{ZAP_ENDPOINT} is taken ({exc}): another library runs one on zmq.Context.instance()")
        threading.Thread(target=self._serve, name="channel-gate", daemon=True).start()

    def _serve(self) -> None:
        while True:
            try:
                request = self.sock.recv_multipart()
            except zmq.ContextTerminated:
                self.sock.close()
                return
            if len(request) < 6:  # (not libzmq's: a REP socket must still answer, or it stops taking requests)
                self.sock.send_multipart([b"1.0", b"", b"500", b"malformed ZAP request", b"", b""])
                continue
            version, request_id, domain, address, _identity, mechanism, *credentials = request
            with self.lock:
                door = self.doors.get(domain)
            admitted = door is not None and door.admits(mechanism, credentials)
            if not admitted and door is not None:  # (noted before the peer hears of it)
                self._note_refusal(door, describe(address.decode(errors="replace")), mechanism)
            status = (b"200", b"OK") if admitted else (b"400", b"no valid rlinf-pipe channel key")
            self.sock.send_multipart([version, request_id, *status, b"", b""])

    def _note_refusal(self, door: Door, peer: str, mechanism: bytes) -> None:
        with self.lock:
            if peer in door.refused:
                return
            door.refused.append(peer)
        log.warning("channel %r: refused a connection from %s: it did not prove this run's channel key (%s); it was "
                    "sent nothing and nothing it sends is read. Further refusals of it are not logged", door.channel,
                    peer, mechanism.decode(errors="replace"))


def describe(address: str) -> str:
    """A ZAP peer address in words: an IP for tcp; libzmq gives `localhost:uid:gid:pid` for a local socket."""
    parts = address.split(":")
    if len(parts) == 4 and parts[0] == "localhost":
        return f"a local process (pid {parts[3]}, uid {parts[1]})"
    return address or "a local process"


_gate: _Gate | None = None
_gate_lock = threading.Lock()


def _the_gate() -> _Gate:
    """The gate of this process's shared ZeroMQ context, started on first use (again in a forked child)."""
    global _gate
    context = zmq.Context.instance()
    with _gate_lock:
        if _gate is None or _gate.context is not context or _gate.pid != os.getpid():
            _gate = _Gate(context)
        return _gate


def guard(sock: zmq.Socket, channel: str, key: ChannelKey | None, encrypt: bool, producer_id: str) -> Door:
    """Make `sock` (a producing end's, before it binds) admit only peers that prove the key."""
    key = _key_of(channel, key, encrypt)
    gate = _the_gate()
    if encrypt:
        public, secret = curve_keys(key)
        sock.curve_secretkey, sock.curve_publickey, sock.curve_server = secret, public, True
        door = Door(channel, producer_id.encode(), b"CURVE", z85.decode(public))
    else:
        sock.plain_server = True
        door = Door(channel, producer_id.encode(), b"PLAIN", password(key, producer_id))
    sock.zap_domain = door.domain
    with gate.lock:
        gate.doors[door.domain] = door
    door.gate = gate
    return door


def retire(door: Door) -> None:
    """The socket of `door` closed: later handshakes naming it are refused."""
    if door.gate is not None:
        with door.gate.lock:
            door.gate.doors.pop(door.domain, None)


def present(sock: zmq.Socket, channel: str, key: ChannelKey | None, encrypt: bool, producer_id: str) -> None:
    """Give `sock` (a consuming end's, before it connects) the credentials of the producer `producer_id`."""
    key = _key_of(channel, key, encrypt)
    if encrypt:
        public, secret = curve_keys(key)
        sock.curve_serverkey, sock.curve_publickey, sock.curve_secretkey = public, public, secret
    else:
        sock.plain_username, sock.plain_password = USERNAME, password(key, producer_id)
