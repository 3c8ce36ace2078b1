"""Helpers of the GPU smoke suite (tests/gpu/). `RLINF_PIPE_GPU_DRY_RUN=1` runs the suite's logic on CPU (gloo for
NCCL, host memory for device memory, memory figures skipped), so a change to it can be tried without a GPU."""

from __future__ import annotations

import os

import pytest
import torch

DRY_RUN_ENV = "RLINF_PIPE_GPU_DRY_RUN"


def dry_run() -> bool:
    """Whether the GPU suite runs on CPU (no memory figures, gloo instead of NCCL)."""
    return os.environ.get(DRY_RUN_ENV, "") not in ("", "0")


def device(index: int = 0) -> torch.device:
    return torch.device("cpu") if dry_run() else torch.device("cuda", index)


def backend() -> str:
    """The collective backend between GPUs."""
    return "gloo" if dry_run() else "nccl"


def gpu_count() -> int:
    if dry_run():
        return 2
    return torch.cuda.device_count() if torch.cuda.is_available() else 0


def needs_gpus(count: int) -> pytest.MarkDecorator:
    return pytest.mark.skipif(gpu_count() < count, reason=f"needs {count} GPUs (this machine has {gpu_count()})")


def measures_memory() -> bool:
    """Whether device memory figures are real (not in a dry run)."""
    return not dry_run()


def allocated() -> int:
    """Bytes the caching allocator has handed out on the current GPU (0 in a dry run)."""
    return torch.cuda.memory_allocated() if measures_memory() else 0


def free_bytes() -> int:
    """Free memory of the current GPU as the driver sees it (`mem_get_info`; 0 in a dry run)."""
    return torch.cuda.mem_get_info()[0] if measures_memory() else 0
