"""Ray's auto-init, turned off in every process that imports our Ray code.

Ray starts (or joins) a cluster on the first API call made while disconnected, a method call on an actor handle
included. A background thread of ours that makes such a call just after `ray.shutdown()` (a channel's I/O thread
refreshing its producers, a producer announcing its end) would then start a new local Ray cluster in a process
whose job is over, and leave it behind. Our processes always connect explicitly (`scheduler.cluster.Cluster`,
or Ray itself in a worker), so a call while disconnected must fail instead.
"""

from __future__ import annotations

import os


def disable_auto_init() -> None:
    """Turn Ray's auto-init off here and in the processes this one starts (idempotent)."""
    os.environ["RAY_ENABLE_AUTO_CONNECT"] = "0"  # read by Ray when it is imported: child processes
    from ray._private import auto_init_hook

    auto_init_hook.enable_auto_connect = False  # read on every call: this process, Ray already imported
