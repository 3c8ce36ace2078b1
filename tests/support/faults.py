"""Faults injected into a running job from the test process: a thread that, when a checkpoint of the run becomes
complete, kills (SIGKILL) or stops (SIGSTOP: alive but not answering) a named worker process, or signals the
driver (this process)."""

from __future__ import annotations

import os
import signal
import threading
import time
from dataclasses import dataclass
from pathlib import Path

import ray


@dataclass(frozen=True)
class Fault:
    """Send `signum` (0: none, only the pid is recorded) to `target` (a worker's actor name, or a pid) once
    `checkpoint` (e.g. `step_000001`) of the run is complete and the run has recorded `restarts` restarts (a
    restart is recorded once the relaunched workers are ready, just before the run trains again)."""

    checkpoint: str
    target: str | int
    signum: int
    restarts: int = 0


class Saboteur(threading.Thread):
    """Applies `faults` in order to the one run under `output_dir`; `pids` lists what it signalled. `stop()` ends
    the thread and resumes (then kills) any process it stopped, so nothing is left behind."""

    def __init__(self, output_dir: Path, faults: list[Fault], poll_s: float = 0.01):
        super().__init__(daemon=True)
        self.output_dir, self.faults, self.poll_s = output_dir, faults, poll_s
        self.pids: list[int] = []
        self.error: BaseException | None = None
        self._done = threading.Event()

    def _due(self, fault: Fault) -> bool:
        if not any(self.output_dir.glob(f"*/*/checkpoints/{fault.checkpoint}/COMPLETE")):
            return False
        events = [line for path in self.output_dir.glob("*/*/events.jsonl")
                  for line in path.read_text().splitlines() if '"restart"' in line]
        return len(events) >= fault.restarts

    def _pid(self, actor_name: str) -> int:
        return ray.get(ray.get_actor(actor_name).ping.remote(), timeout=30)

    def run(self) -> None:
        try:
            for fault in self.faults:
                while not self._due(fault):
                    if self._done.wait(self.poll_s):
                        return
                pid = fault.target if isinstance(fault.target, int) else self._pid(fault.target)
                os.kill(pid, fault.signum)
                if pid != os.getpid():
                    self.pids.append(pid)
        except BaseException as exc:  # reported by stop()
            self.error = exc

    def stop(self) -> None:
        self._done.set()
        self.join(timeout=30)
        for pid in self.pids:
            for sig in (signal.SIGCONT, signal.SIGKILL):
                try:
                    os.kill(pid, sig)
                except ProcessLookupError:
                    break
        if self.error is not None:
            raise self.error


def wait_for(predicate, timeout_s: float, poll_s: float = 0.05) -> bool:
    """Poll `predicate` until it holds or `timeout_s` passed; returns whether it held."""
    deadline = time.monotonic() + timeout_s
    while not predicate():
        if time.monotonic() > deadline:
            return False
        time.sleep(poll_s)
    return True


def reward_pool_processes() -> list[int]:
    """Pids of the multiprocessing forkservers (the reward pools' process parents) that are not this process's own:
    a worker's pool must go with the worker."""
    found = []
    for proc in Path("/proc").iterdir():
        try:
            cmdline = (proc / "cmdline").read_bytes().replace(b"\0", b" ")
            ppid = int((proc / "stat").read_text().rsplit(")", 1)[1].split()[1])
        except (OSError, ValueError, IndexError):
            continue
        if b"multiprocessing.forkserver import main" in cmdline and ppid != os.getpid():
            found.append(int(proc.name))
    return found
