"""Shared test setup: tests/ is importable in Ray workers too; `gpu` tests are skipped without CUDA."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

# Imported now, not by hypothesis's end-of-session summary: that lazy import compiles hypothesis's modules while a
# run's leftover threads may be compiling too, and CPython 3.11's AST converter counts its recursion depth in state
# the threads share ("SystemError: AST constructor recursion depth mismatch" after a single e2e test passed).
try:
    import hypothesis.internal.observability  # noqa: F401
except ImportError:  # (another hypothesis layout: nothing to import ahead)
    pass

# Ray workers inherit the environment of the process that starts Ray (these tests): let them import tests.support.
_TESTS = str(Path(__file__).resolve().parent)
os.environ["PYTHONPATH"] = os.pathsep.join(p for p in (_TESTS, os.environ.get("PYTHONPATH", "")) if p)


ALONE_DIRS = ("e2e", "gpu")
"""Test folders whose tests are all `alone` (scripts/test.sh runs them after the tests that run two at a time)."""


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    for item in items:
        if item.path.parent.name in ALONE_DIRS and item.path.parent.parent.name == "tests":
            item.add_marker(pytest.mark.alone)
    if not any(item.get_closest_marker("gpu") for item in items):
        return
    import torch
    from support.gpu import dry_run

    if torch.cuda.is_available() or dry_run():
        return
    skip = pytest.mark.skip(reason="needs CUDA (this machine has none)")
    for item in items:
        if item.get_closest_marker("gpu"):
            item.add_marker(skip)


_RAY_LEFT: list[str] = []  # "<module> (before|after)": where a Ray connection was found left over


def _disconnect_leftover_ray(where: str) -> None:
    import sys

    ray = sys.modules.get("ray")
    if ray is not None and ray.is_initialized():
        _RAY_LEFT.append(where)
        ray.shutdown()


@pytest.fixture(scope="module", autouse=True)
def _no_ray_across_modules(request: pytest.FixtureRequest):
    """Every module starts and ends with this process disconnected from Ray. A connection left over (a module
    without its own shutdown) is shut down here and reported at the end of the run: left in place it would fail
    the next module's Ray fixture. (The suite's earlier silent exits, status 1 with no summary, came from a channel
    thread calling into Ray while a module's `ray.shutdown()` tore it down; `rlinf_pipe.utils.ray_guard` now
    stops those threads first.)"""
    _disconnect_leftover_ray(f"{request.module.__name__} (found before it)")
    yield
    _disconnect_leftover_ray(f"{request.module.__name__} (left after it)")


def pytest_terminal_summary(terminalreporter) -> None:
    if _RAY_LEFT:
        terminalreporter.write_line("warning: a Ray connection was left over and shut down: " + "; ".join(_RAY_LEFT))
