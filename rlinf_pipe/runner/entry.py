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
from rlinf_pipe.runner.stop import StopSignals
from rlinf_pipe.scheduler.cluster import Cluster

T = TypeVar("T")

if TYPE_CHECKING:
    from rlinf_pipe.runner.preflight import Preflight
    from rlinf_pipe.runner.prepare import PreparedRun
    from rlinf_pipe.runner.runner import Runner


def run(cfg: Config) -> Path:
    """Run `cfg` end to end (starting or joining Ray, and leaving it as it was); returns the run folder. SIGINT and
    SIGTERM stop it cleanly (`rlinf_pipe.runner.stop`): `RunStopped` says where and how to resume."""
    with StopSignals(cfg.runner.stop_grace_s) as stop:
        checked: Future[Preflight] = Future()
        preparing = _in_background(_prepare, cfg, checked)
        from rlinf_pipe.runner.preflight import preflight  # (imports torch: after the helper started)

        try:
            checked.set_result(preflight(cfg))
        except BaseException as exc:
            checked.set_exception(exc)
            raise
        cluster = Cluster(cfg)
        try:
            runner_class, prepared = preparing.result()
            runner = runner_class.start(cfg, stop, cluster, prepared)
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


def _prepare(cfg: Config, checked: Future[Preflight]) -> tuple[type[Runner], PreparedRun]:
    """(The helper thread) import the driver stack, then prepare the run once it passed its checks."""
    from rlinf_pipe.runner.prepare import prepare_run
    from rlinf_pipe.runner.runner import Runner

    return Runner, prepare_run(cfg, checked.result())
