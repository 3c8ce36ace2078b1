"""Importing megatron-core without paying for torch.compile at import time.

megatron-core decorates its fused kernels (bias-GeLU, SwiGLU, RoPE, ...) with `torch.compile` when its module
is imported; the first such call imports TorchDynamo, about 1.5 s of CPU per process (more while the other
workers of a job start on the same cores). Our model configs turn those fusions off, so the compiled functions
never run. `import_megatron_core()` imports the package with `torch.compile` standing in for a deferred version
of itself: a decorated function is compiled by the real `torch.compile`, with the same arguments, on its first
call, and never if it is never called.
"""

from __future__ import annotations

import functools
import sys
import threading
from collections.abc import Callable
from types import ModuleType
from typing import Any

_lock = threading.Lock()


def deferred_compile(compile_fn: Callable[..., Any]) -> Callable[..., Any]:
    """A stand-in for `compile_fn` (torch.compile) that compiles each function on its first call."""

    def compile_later(model: Any = None, **options: Any) -> Any:
        if model is None:  # used as @torch.compile(**options)
            return lambda fn: compile_later(fn, **options)
        compiled: list[Any] = []

        @functools.wraps(model)
        def call(*args: Any, **kwargs: Any) -> Any:
            if not compiled:
                compiled.append(compile_fn(model, **options))
            return compiled[0](*args, **kwargs)

        return call

    return compile_later


def import_megatron_core() -> ModuleType:
    """`megatron.core`, imported once with its `torch.compile` decorators deferred (see the module docstring)."""
    if "megatron.core" in sys.modules:
        return sys.modules["megatron.core"]
    import torch

    with _lock:
        real = torch.compile
        torch.compile = deferred_compile(real)
        try:
            import megatron.core
        finally:
            torch.compile = real
    return megatron.core
