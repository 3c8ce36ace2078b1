"""The processes a previous SGLang engine left on the same GPUs, waited for before a new engine is built there.

A relaunched rollout worker starts while the killed one's scheduler and detokenizer processes may still be dying:
they die by their parent-death signal, asynchronously, and hold their GPU memory until the driver has torn their
CUDA context down (seconds; sglang's own restarts wait up to a minute). A new engine that measures the free memory
meanwhile sizes its KV cache on what they still hold, or finds too little and fails. So each engine records the
processes under it (pid and start time, per first GPU, in a folder of this user's), and the next engine on that
GPU waits until they are gone (`LEFTOVER_WAIT_S` at most, then warns and goes on). A GPU is named as the process
sees it in `CUDA_VISIBLE_DEVICES` (the physical id or UUID the workers are given), so two Ray clusters on one host
that number their GPUs from 0 do not wait for each other's engines.
"""

from __future__ import annotations

import logging
import os
import tempfile
from pathlib import Path

import psutil

log = logging.getLogger(__name__)

LEFTOVER_WAIT_S = 60.0
RECORD_DIR = Path(tempfile.gettempdir()) / f"rlinf_pipe-{os.getuid()}"


def record_path(first_gpu: int) -> Path:
    """The record of the engines whose first GPU is `first_gpu` (this node's index; the physical device it is in
    `CUDA_VISIBLE_DEVICES` when that is set)."""
    visible = [d.strip() for d in os.environ.get("CUDA_VISIBLE_DEVICES", "").split(",") if d.strip()]
    device = visible[0] if visible else str(first_gpu)  # (the engine's first GPU is the first one it sees)
    return RECORD_DIR / f"sglang-gpu{device.replace('/', '_')}.pids"


def record_children(first_gpu: int) -> list[int]:
    """Record this process's child processes (the engine's) as the ones an engine on `first_gpu` runs; their
    pids."""
    children = psutil.Process().children(recursive=True)
    path = record_path(first_gpu)
    path.parent.mkdir(parents=True, exist_ok=True)
    partial = path.with_suffix(f".{os.getpid()}.tmp")
    partial.write_text("".join(f"{c.pid} {c.create_time()!r}\n" for c in children))
    partial.replace(path)
    return [c.pid for c in children]


def wait_for_exit(recorded: list[tuple[int, float]], timeout_s: float) -> list[int]:
    """Wait up to `timeout_s` until the recorded processes (pid, start time) are gone; the pids still running. A pid
    now held by another process (another start time) is not waited for."""
    procs = []
    for pid, started in recorded:
        try:
            proc = psutil.Process(pid)
            if pid != os.getpid() and proc.create_time() == started:
                procs.append(proc)
        except psutil.NoSuchProcess:
            continue
    _, alive = psutil.wait_procs(procs, timeout=timeout_s)
    return [p.pid for p in alive]


def recorded(first_gpu: int) -> list[tuple[int, float]]:
    """The processes (pid, start time) the last engine on `first_gpu` recorded (none: no readable record)."""
    try:
        lines = record_path(first_gpu).read_text().splitlines()
        return [(int(pid), float(started)) for pid, started in (line.split() for line in lines if line.strip())]
    except (OSError, ValueError):
        return []


def wait_for_leftovers(first_gpu: int, timeout_s: float | None = None) -> list[int]:
    """Before an engine starts on `first_gpu`: wait for the processes the last engine there recorded; the pids still
    running after `timeout_s` (default `LEFTOVER_WAIT_S`; logged)."""
    timeout_s = LEFTOVER_WAIT_S if timeout_s is None else timeout_s
    alive = wait_for_exit(recorded(first_gpu), timeout_s)
    if alive:
        log.warning("the processes %s of an earlier SGLang engine on GPU %d are still running after %g s; starting "
                    "anyway (the new engine may find less free memory)", alive, first_gpu, timeout_s)
    return alive
