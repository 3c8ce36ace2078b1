"""What sglang 0.5.23 does to the process that builds its Engine, and how `SGLangEngine` keeps it to the engine.

Read in the wheel (the contract's `host_process`, tests/support/sglang_contract.json):

* importing its engine and tokenizer-manager modules switches the process's asyncio policy to uvloop's, so every
  event loop made afterwards in the process (`asyncio.run`, a Ray concurrency group's loop) would be uvloop's;
* building an Engine forces the multiprocessing start method to `spawn` (a process started afterwards through the
  default context pays a fresh interpreter and re-imports) and sets `ENGINE_ENVIRONMENT` in `os.environ`
  (NCCL's cuMem and NVLS off unless set, `CUDA_DEVICE_MAX_CONNECTIONS=8`, kernel-library settings, a run id);
* it registers `atexit` shutdown, which keeps the Engine alive for the process's life and, at its exit, kills
  every descendant of the process;
* `Engine.shutdown` SIGKILLs every descendant of the calling process, not only the engine's, and waits up to
  `SHUTDOWN_WAIT_S` until they are gone.

`contained()` wraps the import and the build: the policy, the start method and those variables are put back as they
were once the Engine is built (its schedulers were started with sglang's settings and keep them). After the
adapter's own shutdown `forget_atexit` drops sglang's exit hook. `EngineProcesses` tells the engine's processes
(those started while it was built, and theirs) from the others its shutdown would kill, and names those. What it
does not undo: sglang raises the open-file and stack limits of the process (`set_ulimit`), which only widens them.
"""

from __future__ import annotations

import asyncio
import atexit
import contextlib
import logging
import multiprocessing
import os
from collections.abc import Callable, Iterator

import psutil

log = logging.getLogger(__name__)

ENGINE_ENVIRONMENT = ("CUDA_DEVICE_MAX_CONNECTIONS", "CUTE_DSL_LOG_LEVEL", "CUTE_DSL_LOG_TO_CONSOLE",
                      "NCCL_CUMEM_ENABLE", "NCCL_GRAPH_MIXING_SUPPORT", "NCCL_NVLS_ENABLE", "SGLANG_RUN_ID",
                      "TRTLLM_ENABLE_PDL")
"""The variables sglang 0.5.23's `_set_envs_and_config` sets in the building process (checked against the wheel)."""

SHUTDOWN_WAIT_S = 60.0
"""How long sglang 0.5.23's `Engine.shutdown` waits for the processes it kills (`kill_process_tree(...,
wait_timeout=60)`): a stopping rollout worker's grace must cover it (`runner.components.exit_grace_s`)."""


@contextlib.contextmanager
def contained() -> Iterator[None]:
    """Put the asyncio policy, the multiprocessing start method and `ENGINE_ENVIRONMENT` back as they were before
    the block (which imports sglang and builds the Engine), whether it succeeds or not."""
    policy = asyncio.get_event_loop_policy()
    start_method = multiprocessing.get_start_method(allow_none=True)
    environment = {key: os.environ.get(key) for key in ENGINE_ENVIRONMENT}
    try:
        yield
    finally:
        asyncio.set_event_loop_policy(policy)
        multiprocessing.set_start_method(start_method, force=True)
        for key, value in environment.items():
            if value is None:
                os.environ.pop(key, None)
            else:
                os.environ[key] = value


def forget_atexit(shutdown: Callable[[], object]) -> None:
    """Drop the Engine's `atexit` shutdown once it was shut down: the hook holds the Engine (its tokenizer manager,
    sockets and model config) for the rest of the process's life, and at exit it would kill every descendant of the
    process again."""
    atexit.unregister(shutdown)


def _descendants() -> list[psutil.Process]:
    try:
        return psutil.Process().children(recursive=True)
    except psutil.NoSuchProcess:
        return []


class EngineProcesses:
    """The processes an Engine started: call `before()` ahead of the build and `after()` once it is built."""

    def __init__(self) -> None:
        self._earlier: set[int] = set()
        self.pids: set[int] = set()

    def before(self) -> None:
        self._earlier = {p.pid for p in _descendants()}

    def after(self) -> None:
        self.pids = {p.pid for p in _descendants()} - self._earlier

    def _is_engines(self, proc: psutil.Process) -> bool:
        try:
            return proc.pid in self.pids or any(parent.pid in self.pids for parent in proc.parents())
        except psutil.NoSuchProcess:
            return True  # (gone already: nothing to kill)

    def others(self) -> list[str]:
        """The descendants of this process that the engine did not start, as `pid (name)`."""
        out = []
        for proc in _descendants():
            if not self._is_engines(proc):
                with contextlib.suppress(psutil.NoSuchProcess):
                    out.append(f"{proc.pid} ({' '.join(proc.cmdline()[:3]) or proc.name()})")
        return out

    def warn_about_others(self) -> list[str]:
        """Before sglang's shutdown: name, in a warning, the processes it will kill that are not the engine's."""
        others = self.others()
        if others:
            log.warning("sglang's Engine.shutdown SIGKILLs every descendant of this process, and these were not "
                        "started by the engine: %s. Start them in another process, or shut the engine down before "
                        "starting them", ", ".join(others))
        return others
