"""Handing a process's cached GPU memory back to the driver."""

from __future__ import annotations


def hand_back_cached_memory() -> None:
    """Return the caching allocator's free GPU blocks (and those other processes were reading by IPC handle) to the
    driver. A process that shares its GPU with one allocating outside torch's allocator (an SGLang engine, through
    its memory saver) calls it when its turn ends: blocks it keeps cached would be missing there. No-op without
    CUDA."""
    import torch

    if torch.cuda.is_available() and torch.cuda.is_initialized():
        torch.cuda.ipc_collect()
        torch.cuda.empty_cache()
