"""The reward pool's worker process (`RewardPool`, `rlinf_pipe.engines.reward.pool`): warm up, say ready, then score
one item at a time from its pipe until told to stop or its parent goes away."""

from __future__ import annotations

import logging
import os
import signal
import traceback
from multiprocessing.connection import Connection

from rlinf_pipe.engines.reward.verify import Scorer, warm_up

logger = logging.getLogger(__name__)


def serve(conn: Connection, scorer: Scorer) -> None:
    """Worker process main: warm up, say ready, then score items until told to stop or the parent goes away."""
    die_with_parent()
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # Ctrl-C is the parent's to handle
    try:
        warm_up()
        getattr(scorer, "warm_up", lambda: None)()  # (a reward function's file imports here, not in an item)
    except Exception:
        logger.warning("reward worker warm-up failed:\n%s", traceback.format_exc())
    conn.send(("ready", os.getpid()))
    while True:
        try:
            message = conn.recv()
        except (EOFError, OSError):
            return
        if message is None:
            return
        task_id, response, reference = message
        try:
            reply = ("done", task_id, scorer(response, reference))
        except Exception:
            reply = ("error", task_id, traceback.format_exc())
        conn.send(reply)


def die_with_parent() -> None:
    """Linux: get SIGKILL when the parent (the forkserver, which exits with the pool's process) dies, so a worker
    stuck in sympy never outlives a killed Ray actor."""
    parent = os.getppid()
    try:
        import ctypes

        ctypes.CDLL(None, use_errno=True).prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG
    except (OSError, AttributeError):
        return
    if os.getppid() != parent:  # the parent died before the request took effect
        os._exit(0)
