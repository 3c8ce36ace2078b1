"""Message kinds between channel endpoints. Frame 0 is the kind; control payloads are msgpack.

producer -> consumer: ITEM [metas, then each item's frames: header, *buffers] (metas: one (seq, step, weight,
                      frame count) per item; several items to one consumer share a message), STEP_END [step],
                      STATE [ended, closed],
                      CLOSED [ended], HEARTBEAT
consumer -> producer: HELLO [credit], CREDIT [taken seqs, delivered seqs], BYE, HEARTBEAT
"""

from __future__ import annotations

import uuid

import msgspec
import zmq

ITEM, STEP_END, STATE, CLOSED, HELLO, CREDIT, BYE, HEARTBEAT = (bytes([i]) for i in range(1, 9))

pack = msgspec.msgpack.encode
unpack = msgspec.msgpack.decode


class Wakeup:
    """Wakes an I/O thread's poll from other threads. At most one wake-up is pending, so callers never block on
    it. Use `wake()` and `drain()` with the owner's lock held; poll `rx` in the I/O thread."""

    def __init__(self) -> None:
        context = zmq.Context.instance()
        address = f"inproc://rlp-wake-{uuid.uuid4().hex}"
        self.rx = context.socket(zmq.PAIR)
        self.rx.bind(address)
        self._tx = context.socket(zmq.PAIR)
        self._tx.connect(address)
        self._pending = False

    def wake(self) -> None:
        if not self._pending:
            self._pending = True
            try:
                self._tx.send(b"", zmq.NOBLOCK)
            except zmq.Again:
                pass

    def drain(self) -> None:
        while self.rx.poll(0):
            self.rx.recv()
        self._pending = False

    def close(self) -> None:
        self.rx.close(linger=0)
        self._tx.close(linger=0)
