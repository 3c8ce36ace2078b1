"""What building sglang 0.5.23's Engine does to the process that builds it, as the contract's `host_process` records
it from the wheel, done by the stand-in the same way:

* importing its engine and tokenizer-manager modules switches the process's asyncio event-loop policy (sglang's
  to uvloop's; here to `StandinLoopPolicy`, whose loops are marked as the stand-in's), for every loop made after;
* building an Engine forces the multiprocessing start method (`spawn`) and sets environment variables (NCCL's
  cuMem and NVLS off unless set, `CUDA_DEVICE_MAX_CONNECTIONS=8`, a run id, kernel-library settings);
* `Engine.shutdown` SIGKILLs every descendant of the calling process, not only the engine's, and waits until the
  kernel has reaped them (sglang: up to 60 s, then `RuntimeError`). On a GPU that wait covers the teardown of each
  killed process's CUDA context; the stand-in's processes have none, so a test may ask for a teardown time
  (`TEARDOWN_FILE_ENV` names a file holding seconds) to see what a stopping worker's grace must cover.
"""

from __future__ import annotations

import asyncio
import multiprocessing
import os
import time
import uuid
from pathlib import Path

import psutil

from .contract import CONTRACT

HOST = CONTRACT["host_process"]
TEARDOWN_FILE_ENV = "RLINF_PIPE_STANDIN_TEARDOWN_FILE"
# Set only under conditions the stand-in never meets (sglang's decode-context parallelism), so not modelled.
_CONDITIONAL = {"NCCL_GRAPH_MIXING_SUPPORT"}
# Set by sglang only where the user did not set them.
_UNLESS_SET = {"NCCL_CUMEM_ENABLE", "NCCL_NVLS_ENABLE"}


class StandinLoop(asyncio.SelectorEventLoop):
    """A loop made under the switched policy (in sglang: a uvloop loop)."""


class StandinLoopPolicy(asyncio.DefaultEventLoopPolicy):
    """The policy sglang's modules install at import (uvloop's in sglang)."""

    def new_event_loop(self) -> asyncio.AbstractEventLoop:
        return StandinLoop()


def switch_policy(module: str) -> None:
    """At the import of `module` (a path in the wheel): switch the policy if the real module does."""
    if HOST["policy_switched_on_import"][module]:
        asyncio.set_event_loop_policy(StandinLoopPolicy())


def configure_process() -> None:
    """sglang's `_set_envs_and_config`, the parts that touch this process: the environment and the start method."""
    for key, value in HOST["environment_set"].items():
        if key in _CONDITIONAL or (key in _UNLESS_SET and key in os.environ):
            continue
        if key == "SGLANG_RUN_ID":
            value = f"sglang-run-{uuid.uuid4().hex}"
        os.environ[key] = value if value is not None else "0"
    multiprocessing.set_start_method(HOST["start_method_forced"], force=True)


def _holding(procs: list[psutil.Process]) -> list[psutil.Process]:
    """The processes not yet gone (a zombie has freed what it held: gone, as sglang counts it)."""
    alive = []
    for proc in procs:
        try:
            if proc.is_running() and proc.status() != psutil.STATUS_ZOMBIE:
                alive.append(proc)
        except (psutil.NoSuchProcess, OSError):
            pass
    return alive


def kill_descendants(wait_s: float | None = None) -> list[int]:
    """SIGKILL every descendant of this process and wait until they are gone (`RuntimeError` after `wait_s`, default
    the contract's); the pids killed. As sglang's `kill_process_tree(os.getpid(), include_parent=False)`, it polls
    /proc rather than reaping, so a `Popen` still learns its child's exit status."""
    wait_s = HOST["shutdown_kill_wait_s"] if wait_s is None else wait_s
    killed = []
    for child in psutil.Process().children(recursive=True):
        try:
            child.kill()
            killed.append(child)
        except psutil.NoSuchProcess:
            pass
    deadline = time.monotonic() + wait_s
    while alive := _holding(killed):
        if time.monotonic() >= deadline:
            raise RuntimeError(f"kill_process_tree: {len(alive)} process(es) not reaped within {wait_s}s after "
                               f"SIGKILL; pids={[p.pid for p in alive]}")
        time.sleep(0.01)  # (sglang polls /proc the same way)
    teardown = os.environ.get(TEARDOWN_FILE_ENV)
    if killed and teardown and Path(teardown).is_file():
        time.sleep(float(Path(teardown).read_text()))  # the CUDA contexts' teardown a GPU would add
    return [p.pid for p in killed]
