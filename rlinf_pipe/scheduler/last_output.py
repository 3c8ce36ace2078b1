"""What a dead worker printed last: the tail of the file its standard error went to (Ray's `worker-*.err`).

A worker process can be ended without an exception of its own: SGLang's processes send its Engine's process SIGQUIT
when one of them fails (CUDA out of memory, an NCCL error, a scheduler exception), the kernel's OOM killer, a
segfault in a kernel library. Ray then says only that the actor died. The reason is in the worker's output (SGLang's
schedulers write their traceback to the same file, which they inherit), so a lost worker's error carries its last
lines when the driver can read the file (the same node, or shared storage), else where to find it.
"""

from __future__ import annotations

import os

TAIL_LINES = 15
TAIL_BYTES = 16 * 1024
LINE_CHARS = 400


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
