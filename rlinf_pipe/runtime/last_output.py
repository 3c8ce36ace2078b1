"""What a dead worker printed last: the tail of the file its standard error went to (Ray's `worker-*.err`).

A worker process can be ended without an exception of its own: SGLang's processes send its Engine's process SIGQUIT
when one of them fails (CUDA out of memory, an NCCL error, a scheduler exception), the kernel's OOM killer, a
segfault in a kernel library. Ray then says only that the actor died. The reason is in the worker's output (SGLang's
schedulers write their traceback to the same file, which they inherit), so a lost worker's error carries its last
lines when the driver can read the file (the same node, or shared storage), else where to find it. A worker
announces the file first thing in its constructor (Ray's key-value store, by actor id: a relaunched rank is another
actor), so a worker that dies while it builds its models (an SGLang engine that finds too little memory) is
reported with it too.
"""

from __future__ import annotations

import os

TAIL_LINES = 15
TAIL_BYTES = 16 * 1024
LINE_CHARS = 400


OUTPUT_KEY = "rlinf_pipe:output:"  # + the actor id: the file a worker's standard error goes to


def announce_output() -> str:
    """Put this worker's output file (`stderr_file`) in Ray's key-value store under its actor id; the file."""
    import ray
    from ray.experimental import internal_kv

    path = stderr_file()
    actor_id = ray.get_runtime_context().get_actor_id()
    if path and actor_id:
        internal_kv._internal_kv_put(OUTPUT_KEY + actor_id, path)  # noqa: SLF001 - Ray's own KV, no public verb
    return path


def announced_output(actor_id: str) -> str:
    """The output file the worker `actor_id` announced ("" if none)."""
    from ray.experimental import internal_kv

    try:
        found = internal_kv._internal_kv_get(OUTPUT_KEY + actor_id)  # noqa: SLF001
    except Exception:  # (Ray gone, or the store unreachable: nothing to add to an error)  # noqa: BLE001
        return ""
    return found.decode() if found else ""


def forget_output(actor_id: str) -> None:
    from ray.experimental import internal_kv

    try:
        internal_kv._internal_kv_del(OUTPUT_KEY + actor_id)  # noqa: SLF001
    except Exception:  # noqa: BLE001
        pass


def stderr_file() -> str:
    """The regular file this process's standard error goes to (Ray's worker log), or "" (a terminal, a pipe)."""
    try:
        path = os.readlink("/proc/self/fd/2")
    except OSError:
        return ""
    return path if os.path.isfile(path) else ""


def output_tail(path: str, where: str) -> str:
    """The last lines of a dead worker's output file `path` (on the node `where` names), as a paragraph for its
    error; where the file is when it cannot be read here; "" when there is no file."""
    if not path:
        return ""
    try:
        with open(path, "rb") as f:
            f.seek(max(0, os.fstat(f.fileno()).st_size - TAIL_BYTES))
            text = f.read().decode(errors="replace")
    except OSError:
        return f"its output: {path} on {where}"
    lines = [line[:LINE_CHARS] for line in text.splitlines() if line.strip()][-TAIL_LINES:]
    if not lines:
        return f"its output ({path}) is empty"
    return f"--- the last lines of its output ({path}) ---\n" + "\n".join(lines)
