"""`RewardPool`: score (response, reference) pairs in worker processes, each item under a hard time limit.

    with RewardPool(num_workers=2, timeout_s=5.0) as pool:
        results = pool.score_batch([(response, "72"), ...])   # ScoreResult per pair, in order
        pool.metrics()   # {"items": ..., "correct": ..., "parse_failures": ..., "timeouts": ..., ...}

A reference is what the scorer reads: a string, a list of reference answers, or a `RewardContext`.

Items the math scorer can decide without sympy (`quick_score`: no answer, or integers) are scored in the calling
thread: they cannot hang. Each worker process owns one pipe and scores one item at a time. The calling thread hands items to idle workers and
waits on their pipes; an item still running at its deadline (dispatch time + timeout_s) scores as wrong and timed
out, its process is killed and a fresh one takes its place. Processes start once, in the constructor, from a
forkserver that has math-verify imported and warmed up, so a replacement costs milliseconds. Plain multiprocessing
(no Ray, no signals in the caller): it works in the driver, in a thread, or inside a Ray actor.
"""

from __future__ import annotations

import logging
import multiprocessing
import shutil
import threading
import time
import weakref
from collections import deque
from collections.abc import Sequence
from dataclasses import asdict
from multiprocessing import util as multiprocessing_util
from multiprocessing.connection import Connection, wait
from typing import Any, Self

from rlinf_pipe.engines.reward.context import RewardContext
from rlinf_pipe.engines.reward.counters import RewardCounters
from rlinf_pipe.engines.reward.function import RewardFunctionError
from rlinf_pipe.engines.reward.pool_worker import serve
from rlinf_pipe.engines.reward.verify import MathScorer, RewardFailure, ScoreConfig, ScoreResult, Scorer
from rlinf_pipe.errors import RlinfPipeError

logger = logging.getLogger(__name__)

PRELOAD_MODULE = "rlinf_pipe.engines.reward._preload"
_MAX_START_FAILURES = 3


class RewardPoolError(RlinfPipeError):
    """The reward pool is closed, or its worker processes cannot start."""


class _Slot:
    """One worker process and the parent's end of its pipe."""

    def __init__(self, process: multiprocessing.process.BaseProcess, conn: Connection, start_deadline: float):
        self.process, self.conn = process, conn
        self.ready = False
        self.start_deadline = start_deadline
        self.task: tuple[int, int, float] | None = None  # (task id, item index, deadline)

    def kill(self) -> None:
        if self.process.is_alive():
            self.process.kill()
        self.process.join(timeout=5)
        self.conn.close()


class RewardPool:
    """A fixed number of scoring processes with a per-item timeout (see the module docstring).

    `config` sets the reward values and answer extraction; `scorer` replaces the math scorer by any picklable
    `(response, reference) -> ScoreResult` callable (a reward function from a file, tests, other verifiable
    tasks); its `quick` method, if any, scores what it can in the calling thread, and its `warm_up`, if any, runs
    in each process before it says ready. `timeout_s` None or <= 0 means no limit. A result with an `error` is
    logged once per place it failed; with `fail_on_error`, `score_batch` then raises `RewardFunctionError`.
    """

    def __init__(
        self,
        num_workers: int = 1,
        timeout_s: float | None = 5.0,
        config: ScoreConfig | None = None,
        *,
        scorer: Scorer | None = None,
        fail_on_error: bool = False,
        start_method: str | None = None,
        start_timeout_s: float = 120.0,
    ):
        if num_workers < 1:
            raise ValueError(f"reward pool needs num_workers >= 1, got {num_workers}")
        self.num_workers = num_workers
        self.timeout_s = timeout_s if timeout_s and timeout_s > 0 else None
        self.config = config or ScoreConfig()
        self._scorer: Scorer = scorer or MathScorer(self.config)
        self._quick = getattr(self._scorer, "quick", None)  # (the math scorer's: `quick_score` decides what it can)
        self.fail_on_error = fail_on_error
        self._reported: set[tuple[str, str]] = set()  # (where, kind) of the failures logged
        self._start_timeout_s = start_timeout_s
        self._ctx = _context(start_method)
        self._counters = RewardCounters()
        self._lock = threading.Lock()
        self._next_task = 0
        self._start_failures = 0
        self._closed = False
        self._slots: list[_Slot] = []
        self._finalizer = weakref.finalize(self, _kill_all, self._slots)
        try:
            for _ in range(num_workers):
                self._slots.append(self._start_slot())
            self._wait_until_ready()
        except BaseException:
            self.close()
            raise

    # --- public API -------------------------------------------------------------------------------------------
    def score_batch(self, pairs: Sequence[tuple[str, Any]]) -> list[ScoreResult]:
        """Score every (response, reference) pair; results come back in input order. With the math scorer, pairs
        that `quick_score` decides (no answer, or integers: no sympy, so they cannot hang) are scored here, the
        others in the worker processes. With `fail_on_error`, a result with an error raises RewardFunctionError
        once the batch is done."""
        items = [(_text(response), _reference(reference)) for response, reference in pairs]
        with self._lock:
            if self._closed:
                raise RewardPoolError("reward pool is closed")
            self._drop_abandoned_tasks()
            results = self._run(items)
        failure = next((r.error for r in results if r.error is not None), None)
        if failure is not None and self.fail_on_error:
            raise RewardFunctionError(
                f"the reward function failed: {failure} (reward.fail_on_error is true, so the run stops; fix the "
                "function, or set reward.fail_on_error=false to score such samples 0 and go on)"
            )
        return results

    @property
    def counters(self) -> RewardCounters:
        """A snapshot of the counters."""
        return RewardCounters(**asdict(self._counters))

    @property
    def pids(self) -> list[int]:
        """Process ids of the current worker processes (they change when a process is replaced)."""
        return [slot.process.pid for slot in self._slots if slot.process.pid is not None]

    def metrics(self) -> dict[str, float]:
        """The counters as metric values (see `RewardCounters.as_dict`)."""
        return self._counters.as_dict()

    def close(self) -> None:
        """Stop the worker processes (idempotent): busy ones are killed, idle ones are asked to exit and get one
        second to do so."""
        if self._closed:
            return
        self._closed = True
        for slot in self._slots:
            if slot.task is None:
                try:
                    slot.conn.send(None)
                except (OSError, ValueError):
                    pass
            else:
                slot.process.kill()
        exiting = [slot.process.sentinel for slot in self._slots if slot.task is None]
        deadline = time.monotonic() + 1.0
        while exiting and time.monotonic() < deadline:
            for sentinel in wait(exiting, timeout=max(0.0, deadline - time.monotonic())):
                exiting.remove(sentinel)
        for slot in self._slots:
            slot.kill()
        self._slots.clear()
        self._finalizer.detach()

    def __enter__(self) -> Self:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    # --- scheduling -------------------------------------------------------------------------------------------
    def _run(self, items: list[tuple[str, Any]]) -> list[ScoreResult]:
        results: list[ScoreResult | None] = [None] * len(items)
        todo: deque[int] = deque()
        for index, (response, reference) in enumerate(items):
            quick = self._quick(response, reference) if self._quick else None
            if quick is None:
                todo.append(index)
            else:
                self._finish(results, index, quick)
        left = len(todo)
        while left:
            self._dispatch(todo, items)
            left -= self._poll(results)
            left -= self._expire(results)
        return results  # type: ignore[return-value]  # every index was filled

    def _dispatch(self, todo: deque[int], items: list[tuple[str, Any]]) -> None:
        for slot in self._slots:
            if not todo:
                return
            if not slot.ready or slot.task is not None:
                continue
            index = todo.popleft()
            self._next_task += 1
            try:
                slot.conn.send((self._next_task, *items[index]))
            except (OSError, ValueError):  # the process died while idle: try the item elsewhere
                todo.appendleft(index)
                self._replace(slot)
                continue
            deadline = time.monotonic() + self.timeout_s if self.timeout_s else float("inf")
            slot.task = (self._next_task, index, deadline)

    def _seconds_to_next_deadline(self) -> float | None:
        deadlines = [s.task[2] for s in self._slots if s.task] + [s.start_deadline for s in self._slots if not s.ready]
        finite = [d for d in deadlines if d != float("inf")]
        return max(0.0, min(finite) - time.monotonic()) if finite else None

    def _poll(self, results: list[ScoreResult | None], slots: list[_Slot] | None = None) -> int:
        """Wait for a message, a process exit or the next deadline; handle what arrived. Returns items completed."""
        slots = list(slots or self._slots)
        # Keyed before waiting: once a process is replaced, its fd numbers may be reused by the new one.
        by_conn = {id(slot.conn): slot for slot in slots}
        by_sentinel = {slot.process.sentinel: slot for slot in slots}
        ready = wait([slot.conn for slot in slots] + list(by_sentinel), timeout=self._seconds_to_next_deadline())
        hit: list[_Slot] = []
        for obj in ready:
            slot = by_conn.get(id(obj)) if isinstance(obj, Connection) else by_sentinel.get(obj)  # type: ignore[arg-type]
            if slot is not None and slot not in hit:
                hit.append(slot)
        return sum(self._on_ready(slot, results) for slot in hit)

    def _on_ready(self, slot: _Slot, results: list[ScoreResult | None]) -> int:
        """Read what `slot`'s process sent; if it ended, fail its item and replace it. Returns items completed."""
        if slot not in self._slots:  # replaced earlier in this round
            return 0
        done, ended = 0, False
        try:
            while slot.conn.poll():
                done += self._on_message(slot, slot.conn.recv(), results)
        except (EOFError, OSError):
            ended = True
        if ended or not slot.process.is_alive():
            done += self._on_exit(slot, results)
        return done

    def _on_message(self, slot: _Slot, message: tuple, results: list[ScoreResult | None]) -> int:
        kind = message[0]
        if kind == "ready":
            slot.ready, self._start_failures = True, 0
            return 0
        task_id, payload = message[1], message[2]
        if slot.task is None or slot.task[0] != task_id:
            return 0
        index = slot.task[1]
        slot.task = None
        if kind == "done":
            self._finish(results, index, payload)
        else:
            logger.warning("reward worker pid %s raised while scoring item %d:\n%s", slot.process.pid, index, payload)
            self._finish(results, index, self._error_result(), error=True)
        return 1

    def _on_exit(self, slot: _Slot, results: list[ScoreResult | None]) -> int:
        """The process behind `slot` ended unexpectedly: fail its item (if any) and replace it."""
        done = 0
        if slot.task is not None:
            index = slot.task[1]
            logger.warning(
                "reward worker pid %s died (exit code %s) while scoring item %d; it scores as wrong",
                slot.process.pid,
                slot.process.exitcode,
                index,
            )
            self._finish(results, index, self._error_result(), error=True)
            done = 1
        elif not slot.ready:
            self._start_failed(slot, "exited before it was ready")
        self._replace(slot)
        return done

    def _expire(self, results: list[ScoreResult | None]) -> int:
        """Time out the items past their deadline, except those whose result is already waiting to be read (the
        next `_poll` takes it: it came back while another process's message was being handled)."""
        now, done = time.monotonic(), 0
        for slot in list(self._slots):
            if slot.task is not None and now >= slot.task[2] and not _has_message(slot.conn):
                index = slot.task[1]
                slot.task = None
                self._finish(results, index, self.config.timeout_result(), timed_out=True)
                self._replace(slot)
                done += 1
            elif not slot.ready and now >= slot.start_deadline:
                self._start_failed(slot, f"was not ready after {self._start_timeout_s:g} s")
                self._replace(slot)
        return done

    def _finish(
        self,
        results: list[ScoreResult | None],
        index: int,
        result: ScoreResult,
        *,
        timed_out: bool = False,
        error: bool = False,
    ) -> None:
        results[index] = result
        error = error or result.error is not None
        c = self._counters
        c.items += 1
        c.correct += int(result.correct)
        c.timeouts += int(timed_out or result.timed_out)
        c.errors += int(error)
        c.parse_failures += int(not (result.parsed or result.timed_out or timed_out or error))
        if result.error is not None:
            self._report(result.error)

    def _report(self, failure: RewardFailure) -> None:
        """Log a reward function's failure the first time it fails at that place in that way."""
        if (failure.where, failure.kind) in self._reported:
            return
        self._reported.add((failure.where, failure.kind))
        logger.warning("reward function failed at %s (the sample scores 0; counted in reward/errors, and reported "
                       "once per place and error type)", failure)

    def _error_result(self) -> ScoreResult:
        return ScoreResult(correct=False, parsed=False, timed_out=False, reward=float(self.config.wrong_score))

    # --- processes --------------------------------------------------------------------------------------------
    def _start_slot(self) -> _Slot:
        parent_conn, child_conn = self._ctx.Pipe(duplex=True)
        process = self._ctx.Process(
            target=serve, args=(child_conn, self._scorer), name="rlinf-pipe-reward", daemon=True
        )
        process.start()
        child_conn.close()
        return _Slot(process, parent_conn, time.monotonic() + self._start_timeout_s)

    def _replace(self, slot: _Slot) -> None:
        slot.kill()
        self._slots[self._slots.index(slot)] = self._start_slot()
        self._counters.restarts += 1

    def _start_failed(self, slot: _Slot, why: str) -> None:
        self._start_failures += 1
        if self._start_failures >= _MAX_START_FAILURES:
            raise RewardPoolError(
                f"reward worker process (pid {slot.process.pid}) {why}, {self._start_failures} times in a row; "
                "see its output above. A script that creates a RewardPool must do so under "
                "`if __name__ == '__main__':` (worker processes import the main module); is math-verify installed?"
            )

    def _wait_until_ready(self) -> None:
        while not all(s.ready for s in self._slots):
            self._poll([], [s for s in self._slots if not s.ready])
            self._expire([])

    def _drop_abandoned_tasks(self) -> None:
        """A batch interrupted in the caller (KeyboardInterrupt) may leave items running: restart those workers."""
        for slot in list(self._slots):
            if slot.task is not None:
                self._replace(slot)


def _context(start_method: str | None) -> multiprocessing.context.BaseContext:
    """forkserver where available (fast, fork-safe replacements with math-verify preloaded), else spawn."""
    method = start_method or ("forkserver" if "forkserver" in multiprocessing.get_all_start_methods() else "spawn")
    ctx = multiprocessing.get_context(method)
    if method == "forkserver":
        ctx.set_forkserver_preload(["__main__", PRELOAD_MODULE])  # no effect once the forkserver runs
    return ctx


def remove_process_temp_folder() -> None:
    """Remove this process's multiprocessing folder (`pymp-*` in the temp folder, where a forkserver's socket lives)
    ahead of the process's end: multiprocessing removes it at a normal exit only, and a killed process leaves it.
    No process can be started through this process's forkserver afterwards."""
    shutil.rmtree(multiprocessing_util.get_temp_dir(), ignore_errors=True)


def _kill_all(slots: list[_Slot]) -> None:
    for slot in slots:
        slot.kill()


def _text(value: object) -> str:
    return "" if value is None else str(value)


def _reference(value: object) -> Any:
    """What the scorer receives: a RewardContext or a list of references as they are, anything else as text."""
    return value if isinstance(value, (RewardContext, list, tuple)) else _text(value)


def _has_message(conn: Connection) -> bool:
    """Whether `conn` has something to read (a closed end counts: reading it says the process ended)."""
    try:
        return conn.poll()
    except (EOFError, OSError):
        return True
