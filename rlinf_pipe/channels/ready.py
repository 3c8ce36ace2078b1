"""Waiting on sockets: a consumer's `get` / `aget` sleeps until one of its producer sockets has something to read,
then receives in its own thread or event loop (no hand-off through a receiving thread: at 64 KiB items that
hand-off cost the consumer about as much CPU as the transfer itself).

The waiters poll the sockets' `zmq.FD` descriptors without the lock. libzmq signals such a descriptor when the
socket's state changes, so whoever last used a socket must have received from it until its `zmq.EVENTS` show
nothing to read (`wire.waiting`) before anyone sleeps on it; `ConsumerEnd` ends every use of its sockets with such
a drain, and so does every use of a producer's router (its I/O thread's passes, which poll the router's descriptor
beside a `Doorbell`, and a `put` that sends).
"""

from __future__ import annotations

import asyncio
import os
import select
import threading
import time
from typing import Callable, Sequence, TypeVar

from rlinf_pipe.errors import ChannelTimeout
from rlinf_pipe.channels.buffer import PENDING, RECHECK_S, Waiter

T = TypeVar("T")


class Doorbell:
    """A wake-up pipe for one sleeping thread: `ring` (under its owner's lock) ends the thread's poll of `rx` early;
    the thread `clear`s it (under the lock) once awake. At most one byte is ever pending, so ringing never blocks."""

    def __init__(self) -> None:
        self.rx, self.tx = os.pipe()
        os.set_blocking(self.rx, False)
        os.set_blocking(self.tx, False)
        self.rung = False
        self._poller = select.poll()  # (not select.select: a worker's descriptors may number past 1024)
        self._poller.register(self.rx, select.POLLIN)
        self._watched: tuple[int, ...] = ()  # the other descriptors the poller watches

    def ring(self) -> None:
        if not self.rung and self.tx >= 0:
            self.rung = True
            os.write(self.tx, b"\0")

    def clear(self) -> None:
        if self.rung:
            self.rung = False
            try:
                os.read(self.rx, 64)
            except OSError:  # nothing to read, or closed under a thread that outlived its join
                pass

    def wait(self, seconds: float, fds: tuple[int, ...] = ()) -> None:
        """Sleep until rung, one of `fds` is readable, or `seconds` passed (the caller clears it); at once once
        closed. (The poller is kept while the descriptors stay the same: most waits are of the same sockets.)"""
        if self.rx < 0:
            return
        if fds != self._watched:
            self._poller = select.poll()
            for fd in (self.rx, *fds):
                self._poller.register(fd, select.POLLIN)
            self._watched = fds
        self._poller.poll(seconds * 1000)

    def close(self) -> None:
        """Idempotent (also run when a thread that owned one ends)."""
        fds, self.rx, self.tx = (self.rx, self.tx), -1, -1
        for fd in fds:
            if fd >= 0:
                try:
                    os.close(fd)
                except OSError:
                    pass

    __del__ = close


class SocketWaiter(Waiter):
    """A `Waiter` whose waits also end when one of the descriptors `fds()` returns becomes readable. Threads poll
    them with their own doorbell; event loops watch them with `add_reader`."""

    def __init__(self, lock: threading.RLock, fds: Callable[[], Sequence[int]]):
        super().__init__(lock)
        self._fds = fds
        self._sleeping: set[Doorbell] = set()  # doorbells of the threads polling now
        self._local = threading.local()
        self._watched: dict[asyncio.AbstractEventLoop, tuple[tuple[int, ...], int]] = {}  # loop -> (fds, waits)

    def notify(self) -> None:
        super().notify()
        for bell in self._sleeping:
            bell.ring()

    def _doorbell(self) -> Doorbell:
        bell = getattr(self._local, "bell", None)
        if bell is None:
            bell = self._local.bell = Doorbell()
        return bell

    def wait(self, attempt: Callable[[], T], timeout: float | None, what: str) -> T:
        deadline: float | None = None
        bell: Doorbell | None = None  # (set up at the first sleep: most calls find their result at once)
        while True:
            with self.lock:
                result = attempt()
                if result is not PENDING:
                    return result
                if bell is None:
                    bell = self._doorbell()
                    deadline = None if timeout is None else time.monotonic() + timeout
                fds = tuple(self._fds())
                self._sleeping.add(bell)
            try:
                left = RECHECK_S if deadline is None else deadline - time.monotonic()
                if left <= 0:
                    raise ChannelTimeout(f"{what}: no progress within {timeout:g} s")
                bell.wait(min(left, RECHECK_S), fds)
            finally:
                with self.lock:
                    self._sleeping.discard(bell)
                    bell.clear()

    async def _sleep(self, loop: asyncio.AbstractEventLoop, future: asyncio.Future, seconds: float) -> None:
        fds = tuple(self._fds())
        self._watch(loop, fds, +1)
        try:
            await super()._sleep(loop, future, seconds)
        finally:
            self._watch(loop, fds, -1)

    def _watch(self, loop: asyncio.AbstractEventLoop, fds: tuple[int, ...], change: int) -> None:
        """Count a wait on `loop` in or out; the loop watches every descriptor its waits asked for while any of them
        is on (run in the loop's thread). A descriptor found closed (the end stopped meanwhile) wakes them at once."""
        watched, waits = self._watched.get(loop, ((), 0))
        waits += change
        wanted = tuple(sorted(set(watched) | set(fds))) if change > 0 else watched if waits else ()
        for fd in set(watched) - set(wanted):
            loop.remove_reader(fd)
        for fd in set(wanted) - set(watched):
            try:
                loop.add_reader(fd, self._wake_loop, loop)
            except (OSError, ValueError):
                self._wake_loop(loop)
        if waits:
            self._watched[loop] = (wanted, waits)
        else:
            self._watched.pop(loop, None)

    def _wake_loop(self, loop: asyncio.AbstractEventLoop) -> None:
        """A watched descriptor is readable: wake this loop's waits (they receive when they run)."""
        with self.lock:
            mine = [future for owner, future in self._futures if owner is loop]
            self._futures = [(owner, future) for owner, future in self._futures if owner is not loop]
        for future in mine:
            if not future.done():
                future.set_result(None)

