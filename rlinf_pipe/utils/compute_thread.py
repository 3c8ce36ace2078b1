"""One thread per process for torch's compute, so that torch's intra-op threads form a single OpenMP team.

Torch's intra-op thread count is a per-thread setting, and GNU OpenMP keeps one team of helper threads for every
thread that ever ran a multi-threaded op. Once two threads of a process have teams, it runs more threads than there
are cores and its barriers slow every later op: a Megatron training step of the tiny model at 2 threads took
18.5 ms from one thread and 35 ms from the same thread after the main thread had run a step of its own (2-core CPU,
docs/benchmarks.md). `asyncio.to_thread` hands work to whichever executor thread is free, so workers that ran
their passes there built several teams. A worker runs its torch work through the process's `compute_thread()`
instead: always the same thread, with the intra-op thread count the worker was given.
"""

from __future__ import annotations

import asyncio
import contextvars
import threading
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from typing import Any, TypeVar

T = TypeVar("T")

_shared: ComputeThread | None = None
_shared_lock = threading.Lock()


class ComputeThread:
    """A single long-lived thread that runs callables with `threads` torch intra-op threads (CPU ops only; set in
    that thread before each call when it changed). `run` awaits a call from asyncio, `call` blocks for it; both
    carry the caller's context variables, as `asyncio.to_thread` does."""

    def __init__(self, threads: int = 1, name: str = "compute") -> None:
        if threads < 1:
            raise ValueError(f"threads must be >= 1, got {threads}")
        self.threads = threads
        self.name = name
        self._pool = ThreadPoolExecutor(1, thread_name_prefix=name)
        self._applied = 0  # the thread count last set in the compute thread (0: none yet)
        self.ident: int | None = None  # the compute thread's identifier, once it ran something

    def _enter(self, fn: Callable[..., T], args: tuple, kwargs: dict[str, Any]) -> T:
        self.ident = threading.get_ident()
        if self._applied != self.threads:
            import torch

            torch.set_num_threads(self.threads)
            self._applied = self.threads
        return fn(*args, **kwargs)

    def _submit(self, fn: Callable[..., T], args: tuple, kwargs: dict[str, Any]) -> Any:
        ctx = contextvars.copy_context()
        return self._pool.submit(ctx.run, self._enter, fn, args, kwargs)

    async def run(self, fn: Callable[..., T], /, *args: Any, **kwargs: Any) -> T:
        """`fn(*args, **kwargs)` in the compute thread, awaited."""
        if threading.get_ident() == self.ident:  # already there (a nested call): run inline
            return fn(*args, **kwargs)
        return await asyncio.wrap_future(self._submit(fn, args, kwargs))

    def call(self, fn: Callable[..., T], /, *args: Any, **kwargs: Any) -> T:
        """`fn(*args, **kwargs)` in the compute thread; blocks this (non-compute) thread until it returns."""
        if threading.get_ident() == self.ident:
            return fn(*args, **kwargs)
        return self._submit(fn, args, kwargs).result()

    def close(self) -> None:
        """Let the thread end once its queued calls are done."""
        self._pool.shutdown(wait=False)


def compute_thread(threads: int | None = None) -> ComputeThread:
    """The process's compute thread, created on first use; `threads` (when given) sets its intra-op thread count
    for the calls that follow."""
    global _shared
    with _shared_lock:
        if _shared is None:
            _shared = ComputeThread(threads or 1)
        elif threads is not None:
            if threads < 1:
                raise ValueError(f"threads must be >= 1, got {threads}")
            _shared.threads = threads
        return _shared

