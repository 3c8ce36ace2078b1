"""Shared test setup: `gpu` tests are skipped on machines without CUDA."""

from __future__ import annotations

import pytest


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    if not any(item.get_closest_marker("gpu") for item in items):
        return
    import torch

    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs CUDA (this machine has none)")
    for item in items:
        if item.get_closest_marker("gpu"):
            item.add_marker(skip)
