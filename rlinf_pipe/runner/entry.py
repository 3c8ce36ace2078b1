"""`run(cfg)`: a training job end to end. Starting Ray and preparing the run (importing the driver stack, reading the
model folders and prompts) take seconds each and mostly different cores, so they overlap: a helper thread imports
and prepares while this thread checks the run (`preflight`: its errors show before Ray starts) and then starts or
joins Ray (here, where Ray installs its signal handlers). A run whose preparation fails stops the cluster it started.

Light to import: the driver stack loads in the helper thread."""

from __future__ import annotations

import threading
from collections.abc import Callable
from concurrent.futures import Future
from pathlib import Path
from typing import TYPE_CHECKING, Any, TypeVar

from rlinf_pipe.config.schema import Config
from rlinf_pipe.planning.micro_batch_budget import resolve_micro_batch_tokens
from rlinf_pipe.runner.stop import StopSignals
from rlinf_pipe.runtime.cluster import Cluster
from rlinf_pipe.utils.tracing import LAUNCH_SPAN, Tracer, now

T = TypeVar("T")

if TYPE_CHECKING:
    from rlinf_pipe.runner.preflight import Preflight
    from rlinf_pipe.runner.prepare import PreparedRun
    from rlinf_pipe.runner.runner import Runner


def run(cfg: Config, launched_at: float | None = None) -> Path:
    """Run `cfg` end to end (starting or joining Ray, and leaving it as it was); returns the run folder. SIGINT and
    SIGTERM stop it cleanly (`rlinf_pipe.runner.stop`): `RunStopped` says where and how to resume. The launch's
    spans (`tracing.LAUNCH_SPAN`) go on the run's timeline from `launched_at` (the command's start; default now)."""
    launched_at = now() if launched_at is None else launched_at
    cfg = resolve_micro_batch_tokens(cfg)  # (`auto`: the largest the memory estimate fits, before anything reads it)
    driver, helper = Tracer("driver"), Tracer("driver/prepare")
    with StopSignals(cfg.runner.stop_grace_s) as stop:
        checked: Future[Preflight] = Future()
        preparing = _in_background(_prepare, cfg, checked, helper)
        with driver.span(LAUNCH_SPAN, phase="preflight"):
            from rlinf_pipe.runner.preflight import preflight  # (no torch: the helper thread imports it)

            try:
                checked.set_result(preflight(cfg))
            except BaseException as exc:
                checked.set_exception(exc)
                raise
        with driver.span(LAUNCH_SPAN, phase="ray_start"):
            cluster = Cluster(cfg)
        try:
            runner_class, prepared = preparing.result()
            with driver.span(LAUNCH_SPAN, phase="start_workers"):
                runner = runner_class.start(cfg, stop, cluster, prepared)
            driver.add(LAUNCH_SPAN, launched_at, now(), phase="job")
            runner.spans += driver.drain() + helper.drain()
            try:
                return runner.run()
            finally:
                runner.shutdown()
        finally:
            cluster.shutdown()


def _in_background(fn: Callable[..., T], *args: Any) -> Future[T]:
    """`fn(*args)` in a daemon thread (a run stopped or failed meanwhile does not wait for it to end)."""
    future: Future[T] = Future()

    def target() -> None:
        future.set_running_or_notify_cancel()
        try:
            future.set_result(fn(*args))
        except BaseException as exc:
            future.set_exception(exc)

    threading.Thread(target=target, name="rlinf-prepare", daemon=True).start()
    return future


def _prepare(cfg: Config, checked: Future[Preflight], tracer: Tracer) -> tuple[type[Runner], PreparedRun]:
    """(The helper thread) import the driver stack, then prepare the run once it passed its checks."""
    with tracer.span(LAUNCH_SPAN, phase="import"):
        from rlinf_pipe.runner.prepare import prepare_run
        from rlinf_pipe.runner.runner import Runner

    passed = checked.result()
    with tracer.span(LAUNCH_SPAN, phase="prepare"):
        return Runner, prepare_run(cfg, passed)
