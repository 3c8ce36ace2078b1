"""How many bytes of data (tensors and arrays) pass through this process: in the arguments of its worker-group
calls, and in and out of its channel ends.

The driver's count is `driver/data_bytes` of a step: the pipeline keeps training data out of the driver, so it
stays 0 there (see docs/pipeline.md).
"""

from __future__ import annotations

import dataclasses
import sys
import threading
from typing import Any

import msgspec
import numpy as np

_lock = threading.Lock()
_total = 0


def is_tensor(obj: Any) -> bool:
    """Whether `obj` is a torch tensor, without importing torch (not imported yet: nothing can be a tensor, and a
    process that never needs torch, such as the channel registry, never loads it)."""
    torch = sys.modules.get("torch")
    return torch is not None and isinstance(obj, torch.Tensor)


def payload_bytes(obj: Any, depth: int = 6) -> int:
    """Bytes of the tensors and arrays inside `obj` (through sequences, mappings, msgspec Structs and dataclasses
    down to `depth` levels)."""
    if is_tensor(obj):
        return obj.numel() * obj.element_size()
    if isinstance(obj, np.ndarray):
        return int(obj.nbytes)
    if depth <= 0 or isinstance(obj, (str, bytes, int, float, bool, type(None))):
        return 0
    if isinstance(obj, (list, tuple, set, frozenset)):
        return sum(payload_bytes(x, depth - 1) for x in obj)
    if isinstance(obj, dict):
        return sum(payload_bytes(x, depth - 1) for x in obj.values())
    if isinstance(obj, msgspec.Struct):
        return sum(payload_bytes(getattr(obj, f), depth - 1) for f in obj.__struct_fields__)
    if dataclasses.is_dataclass(obj) and not isinstance(obj, type):
        return sum(payload_bytes(getattr(obj, f.name), depth - 1) for f in dataclasses.fields(obj))
    return 0


def record(nbytes: int) -> None:
    global _total
    if nbytes:
        with _lock:
            _total += nbytes


def total_bytes() -> int:
    """Data bytes that passed through this process since it started."""
    return _total
