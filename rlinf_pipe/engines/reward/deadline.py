"""A best-effort in-process time limit for one verification (SIGALRM; main thread only).

math-verify's own limit (`signal.alarm`) takes whole seconds, cancels any alarm the caller had armed, and raises a
ValueError outside the main thread. This one takes fractional seconds, restores an outer timer (pytest-timeout,
another deadline) when it ends, and is simply skipped outside the main thread. It interrupts Python code only at
bytecode boundaries; the hard guarantee is the process pool (`RewardPool`), which kills a stuck process.
"""

from __future__ import annotations

import logging
import signal
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager

logger = logging.getLogger(__name__)
_warned_thread = False


class VerifyTimeout(BaseException):
    """Raised inside a `deadline` block when its time is up.

    A BaseException, so the broad `except Exception` handlers in math-verify and sympy cannot swallow it.
    """


def can_interrupt() -> bool:
    """Whether a `deadline` can interrupt the calling thread (signals reach the main thread only)."""
    return hasattr(signal, "setitimer") and threading.current_thread() is threading.main_thread()


@contextmanager
def deadline(seconds: float | None) -> Iterator[None]:
    """Raise `VerifyTimeout` in this block after `seconds` of wall time; a no-op for None/<= 0 or off the main
    thread (logged once)."""
    if seconds is None or seconds <= 0:
        yield
        return
    if not can_interrupt():
        _warn_not_main_thread()
        yield
        return

    active = True

    def on_alarm(signum: int, frame: object) -> None:
        if active:  # a signal that lands after the block ended is ignored
            raise VerifyTimeout(f"verification took longer than {seconds:g} s")

    started = time.monotonic()
    previous_handler = signal.signal(signal.SIGALRM, on_alarm)
    outer_delay, outer_interval = signal.setitimer(signal.ITIMER_REAL, seconds)
    try:
        try:
            yield
        finally:
            active = False
    finally:  # runs even when the (one-shot) alarm fired inside the inner finally
        signal.setitimer(signal.ITIMER_REAL, 0)
        signal.signal(signal.SIGALRM, signal.SIG_DFL if previous_handler is None else previous_handler)
        if outer_delay > 0:  # re-arm the caller's timer with what is left of it (fire at once if overdue)
            left = max(outer_delay - (time.monotonic() - started), 1e-6)
            signal.setitimer(signal.ITIMER_REAL, left, outer_interval)


def _warn_not_main_thread() -> None:
    global _warned_thread
    if not _warned_thread:
        _warned_thread = True
        logger.warning(
            "reward: in-process verification timeouts need the main thread; running without one here. "
            "Score through RewardPool, which enforces timeouts by killing the worker process."
        )
