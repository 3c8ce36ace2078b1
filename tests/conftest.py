"""Shared test setup: tests/ is importable in Ray workers too; `gpu` tests are skipped without CUDA."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

# Ray workers inherit the environment of the process that starts Ray (these tests): let them import tests.support.
_TESTS = str(Path(__file__).resolve().parent)
os.environ["PYTHONPATH"] = os.pathsep.join(p for p in (_TESTS, os.environ.get("PYTHONPATH", "")) if p)


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
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
