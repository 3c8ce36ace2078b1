"""Ray's process-wide behaviour that our background threads need changed, in every process that imports our Ray
code.

- Auto-init off. Ray starts (or joins) a cluster on the first API call made while disconnected, a method call on
  an actor handle included. A background thread of ours that makes such a call just after `ray.shutdown()` (a
  channel's I/O thread refreshing its producers, a producer announcing its end) would then start a new local Ray
  cluster in a process whose job is over, and leave it behind. Our processes always connect explicitly
  (`scheduler.cluster.Cluster`, or Ray itself in a worker), so a call while disconnected must fail instead.
- Threads stopped before Ray goes (`stop_before_shutdown`). A call into Ray's core worker *while* `ray.shutdown()`
  tears it down ends the whole process at once with exit status 1 ("The core worker has already been shutdown
  ... The process will exit", in the driver's core log), however the call is guarded. So the channel threads are
  stopped first: `ray.shutdown` is wrapped to run the registered callbacks before it, and they run at interpreter
  exit before Ray's own exit handler.
"""

from __future__ import annotations

import atexit
import functools
import os
import threading
from collections.abc import Callable

_BEFORE_SHUTDOWN: list[Callable[[], None]] = []
_LOCK = threading.Lock()


def disable_auto_init() -> None:
    """Turn Ray's auto-init off here and in the processes this one starts (idempotent)."""
    os.environ["RAY_ENABLE_AUTO_CONNECT"] = "0"  # read by Ray when it is imported: child processes
    from ray._private import auto_init_hook

    auto_init_hook.enable_auto_connect = False  # read on every call: this process, Ray already imported


def stop_before_shutdown(callback: Callable[[], None]) -> None:
    """Run `callback` before `ray.shutdown()` does anything, and at interpreter exit before Ray's own exit handler
    (see the module docstring). Idempotent per callback."""
    import ray

    with _LOCK:
        if callback in _BEFORE_SHUTDOWN:
            return
        _BEFORE_SHUTDOWN.append(callback)
        if not getattr(ray.shutdown, "_rlinf_pipe_guarded", False):
            ray.shutdown = _guarded(ray.shutdown)
        atexit.register(callback)  # (registered after Ray's handler, so it runs before it)


def _run_callbacks() -> None:
    for callback in list(_BEFORE_SHUTDOWN):
        callback()


def _guarded(shutdown: Callable[..., None]) -> Callable[..., None]:
    @functools.wraps(shutdown)
    def guarded(*args, **kwargs):
        _run_callbacks()
        return shutdown(*args, **kwargs)

    guarded._rlinf_pipe_guarded = True  # type: ignore[attr-defined]
    return guarded
