"""Why a worker's process is gone, from the error Ray raised for a call to it.

Ray reports a lost actor process in several ways: `RayActorError` (the process died, was killed, or its node is
gone), `OutOfMemoryError` when Ray's memory monitor killed it because its node ran low on host memory (a sibling
of `RayActorError`, not a subclass, for every call to the actor, the pending ones and the later ones),
`WorkerCrashedError` and `NodeDiedError`. `GONE` holds them all, and `death_cause` keeps the sentence of Ray's long
message that says why (with what to change, for the memory monitor) instead of its first line, which for a dead
actor only says that it died.
"""

from __future__ import annotations

import re

from ray.exceptions import NodeDiedError, OutOfMemoryError, RayActorError, RayTaskError, WorkerCrashedError

GONE: tuple[type[Exception], ...] = (RayActorError, OutOfMemoryError, WorkerCrashedError, NodeDiedError)
CALL_FAILED: tuple[type[Exception], ...] = (RayTaskError, *GONE)  # what a call to a worker can raise from Ray

ANSI_ESCAPES = re.compile(r"\x1b\[[0-9;]*m")
_NODE_ID = re.compile(r",? ID: [0-9a-f]+")
MEMORY_MONITOR_FIX = (
    "Ray's memory monitor kills a worker when its node's host memory use passes RAY_memory_usage_threshold (0.95 "
    "of the node's memory by default): give the node's processes less to hold (smaller data.rollout_batch_size or "
    "actor micro-batches, fewer workers on the node, actor offload only where the host has room) or, on a node "
    "with memory to spare, raise the threshold in the environment of `ray start` (docs/reliability.md)"
)


def death_cause(exc: BaseException) -> str:
    """One paragraph on why the process behind `exc` (one of `GONE`) is gone."""
    text = ANSI_ESCAPES.sub("", str(exc)).strip()
    lines = [line.strip() for line in text.splitlines() if line.strip()] or [type(exc).__name__]
    if isinstance(exc, OutOfMemoryError):
        why = [_NODE_ID.sub("", line) for line in lines if line.startswith(("OOM kill reason", "1 worker"))]
        return " ".join(why or lines[:1]) + ". " + MEMORY_MONITOR_FIX
    if isinstance(exc, RayActorError):
        return next((line for line in lines if line.startswith("The actor is dead because")), lines[0])
    return lines[0]
