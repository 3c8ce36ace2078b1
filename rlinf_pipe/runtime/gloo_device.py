"""One gloo device for all of a process's gloo process groups (`share_gloo_device`).

torch gives every gloo process group a device of its own, and every TCP device a loop thread that wakes every few
milliseconds even when nothing moves. On CPU every torch.distributed group is gloo, and a Megatron rank holds about
23 (its parallel groups, their gloo twins, ours): 32 such ranks on one machine wake about 150,000 times a second,
enough to keep two cores busy while the ranks wait (docs/benchmarks.md#rehearsals). Gloo serves any number of
groups on one device, its one loop thread watching all their connections.
"""

from __future__ import annotations

from datetime import timedelta
from typing import Any

_shared: list[Any] = []  # this process's device, made at its first group (after the worker set GLOO_SOCKET_IFNAME)


def share_gloo_device() -> None:
    """From now on, every gloo process group this process makes uses one device (`torch.distributed`'s own groups
    and Megatron's alike, made through `new_group` / `init_process_group`). Idempotent."""
    import torch.distributed.distributed_c10d as c10d

    base = c10d.ProcessGroupGloo
    if getattr(base, "_rlinf_shared_device", False):
        return

    class SharedDeviceGloo(base):  # type: ignore[misc, valid-type]
        _rlinf_shared_device = True

        def __init__(self, store: Any, rank: int, size: int, timeout: timedelta = timedelta(minutes=30)) -> None:
            if not _shared:
                _shared.append(base.create_default_device())
            options = getattr(base, "_Options")()  # (torch's options class, private in its stubs)
            options._timeout = timeout
            options._devices = list(_shared)
            super().__init__(store, rank, size, options)

    setattr(c10d, "ProcessGroupGloo", SharedDeviceGloo)  # (the name torch's group factory constructs)


def gloo_loop_threads() -> int:
    """How many gloo TCP loop threads this process runs now (Linux; 0 elsewhere)."""
    import os

    try:
        tasks = os.listdir("/proc/self/task")
    except OSError:
        return 0
    count = 0
    for tid in tasks:
        try:
            with open(f"/proc/self/task/{tid}/comm") as f:
                count += f.read().strip() == "gloo_tcp_loop"
        except OSError:
            continue
    return count
