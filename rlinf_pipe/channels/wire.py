"""Message kinds between channel endpoints (frame 0 is the kind; control payloads are msgpack), and their names
and local addresses.

producer -> consumer: ITEM [metas, then the items' frames] (metas: one (seq, step, weight, header, placed) per
                      item, the header being the item's msgpack and `placed` the count of its buffers' frames or,
                      to a consumer that mapped the producer's arena, a place per buffer: None for the next frame,
                      [offset, length] for a region of the arena; several items to one consumer share a message),
                      STEP_END [step],
                      STATE [ended, closed],
                      CLOSED [ended], HEARTBEAT,
                      BYE (the answer to a consumer's BYE: all it sent before reached the producer)
consumer -> producer: HELLO [credit, reader: the pid and start (`arena.process_start`) of a process that mapped
                      the arena, or None, nonce], CREDIT [taken seqs, delivered seqs, released arena
                      offsets, extra credit], BYE, HEARTBEAT
A producer's first message to a consumer is STATE, in reply to its HELLO: [ended, closed, proof], the proof of the
run's channel key for the hello's nonce (`gate.proof`); the consumer reads nothing else from it before.
"""

from __future__ import annotations

import os
import socket
import sys
import tempfile
import uuid
from collections.abc import Iterator
from typing import Any, Sequence

import msgspec
import zmq

from rlinf_pipe.errors import ChannelError

ITEM, STEP_END, STATE, CLOSED, HELLO, CREDIT, BYE, HEARTBEAT = (bytes([i]) for i in range(1, 9))

pack = msgspec.msgpack.encode
unpack = msgspec.msgpack.decode

# pyzmq's Cython methods, under its Python layer: `send_multipart` / `recv_multipart` spend about a microsecond a
# frame in Python (enum flag arithmetic, type checks, a RCVMORE lookup), as much as a 64 KiB item's copy. (Its cffi
# backend, on PyPy, does not mark received frames `more`: there the Python layer is used.)
_CYTHON = zmq.backend.Socket.__module__.startswith("zmq.backend.cython")
_send = zmq.backend.Socket.send
_recv = zmq.backend.Socket.recv
_get = zmq.backend.Socket.get
_EVENTS, _POLLIN = int(zmq.EVENTS), int(zmq.POLLIN)
_MORE = int(zmq.SNDMORE)
NOBLOCK = int(zmq.NOBLOCK)


def send(sock: zmq.Socket, frames: Sequence[Any], flags: int = 0) -> None:
    """Send `frames` (bytes and the codec's buffers: nothing is type-checked first) as one multipart message,
    zero-copy above the socket's `copy_threshold`. (A ROUTER raises for an unroutable or full peer at the first
    frame, before any of the message is queued.)"""
    if not _CYTHON:
        sock.send_multipart(frames, flags, copy=False)
        return
    last = len(frames) - 1
    for i, frame in enumerate(frames):
        _send(sock, frame, flags | _MORE if i < last else flags, False)


def recv(sock: zmq.Socket, flags: int = 0) -> list[zmq.Frame]:
    """Receive one multipart message as frames (no copy); raises `zmq.Again` under NOBLOCK when none waits."""
    if not _CYTHON:
        return sock.recv_multipart(flags, copy=False)
    frame = _recv(sock, flags, False)
    frames = [frame]
    while frame.more:  # (the rest of a message arrives with its first frame)
        frame = _recv(sock, flags, False)
        frames.append(frame)
    return frames


def waiting(sock: zmq.Socket) -> Iterator[list[zmq.Frame]]:
    """Every message waiting on `sock`, received until its `zmq.EVENTS` show none: how each use of a socket whose
    descriptor is polled ends (see `ready.py`). (Asking `EVENTS` processes the socket's pending commands as a
    receive does, and costs a third of a receive that raises `zmq.Again`.)"""
    while _get(sock, _EVENTS) & _POLLIN:
        yield recv(sock, NOBLOCK)


def endpoint_id(role: str) -> str:
    """A readable, unique name for this process's end of a channel (it appears in peer errors)."""
    return f"{role}@{socket.gethostname()}:{os.getpid()}:{uuid.uuid4().hex[:6]}"


def bind(sock: zmq.Socket, ip: str, channel: str) -> tuple[str, str]:
    """Bind a producer's socket to a new local address (`ipc_path`) and to a random tcp port of `ip`, the node's
    cluster address (never every interface); returns both addresses."""
    local = f"ipc://{ipc_path(uuid.uuid4().hex[:12])}"
    sock.bind(local)
    host = ip
    if ":" in ip:  # IPv6
        sock.ipv6, host = True, f"[{ip}]"
    try:
        port = sock.bind_to_random_port(f"tcp://{host}")
    except zmq.ZMQError as exc:
        raise ChannelError(f"channel {channel!r}: cannot listen on this node's cluster address {ip} ({exc}); start "
                           "Ray with RAY_NODE_IP set to an address of this machine that the other nodes reach") from exc
    return local, f"tcp://{host}:{port}"


def unbind(local: str) -> None:
    """Remove the socket file of a local address of `bind`'s, if it has one (none in the abstract namespace)."""
    path = local.removeprefix("ipc://")
    if not path.startswith("@"):
        try:
            os.unlink(path)
        except OSError:
            pass


def ipc_path(name: str) -> str:
    """The local socket a producer binds: in Linux's abstract namespace (`@...`: no file, so a killed process leaves
    nothing behind), elsewhere a file in the temp folder (removed when the producer closes)."""
    if sys.platform.startswith("linux"):
        return f"@rlp-{name}"
    return os.path.join(tempfile.gettempdir(), f"rlp-{name}.sock")
