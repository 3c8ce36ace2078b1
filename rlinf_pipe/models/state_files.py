"""The pickled files of a training checkpoint (optimizer state, RNG states), loaded without running code from them:
torch's weights-only unpickler, with the few types those states hold allow-listed. A file that holds anything else
is refused with `UnsafeCheckpointError` naming it: a pickle can carry any callable, which loading would call."""

from __future__ import annotations

import os
import pickle
from collections.abc import Iterable
from typing import Any

import numpy as np
import torch

from rlinf_pipe.errors import UnsafeCheckpointError

_reconstruct = np._core.multiarray._reconstruct if hasattr(np, "_core") else np.core.multiarray._reconstruct
# Beyond tensors and Python's plain values (torch allows those itself): numpy's RNG state, a uint32 array.
ALLOWED: list[Any] = [
    (_reconstruct, "numpy._core.multiarray._reconstruct"),
    (_reconstruct, "numpy.core.multiarray._reconstruct"),  # (the name numpy 1 wrote)
    np.ndarray,
    np.dtype,
    type(np.dtype(np.uint32)),
]
_ALLOWED_NAMES = {entry[1] if isinstance(entry, tuple) else f"{entry.__module__}.{entry.__qualname__}"
                  for entry in ALLOWED}


def load_state(path: str | os.PathLike[str], map_location: Any = None) -> Any:
    """`torch.load` of a checkpoint's state file, refusing anything but tensors, plain values and `ALLOWED`."""
    try:
        with torch.serialization.safe_globals(ALLOWED):
            return torch.load(path, map_location=map_location, weights_only=True)
    except pickle.UnpicklingError as exc:
        raise UnsafeCheckpointError(_refusal(path, unsafe_globals(path) or [str(exc).splitlines()[-1]])) from None


def unsafe_globals(path: str | os.PathLike[str]) -> list[str]:
    """What the pickle of a `torch.save` file names beyond what `load_state` allows (reads the pickle, not the
    tensors: cheap even for a large optimizer state)."""
    found = torch.serialization.get_unsafe_globals_in_checkpoint(path)
    return sorted(set(found) - _ALLOWED_NAMES)


def check_state_files(paths: Iterable[str | os.PathLike[str]]) -> None:
    """Refuse (`UnsafeCheckpointError`) the first file of `paths` that `load_state` would refuse."""
    for path in sorted(map(str, paths)):
        unsafe = unsafe_globals(path)
        if unsafe:
            raise UnsafeCheckpointError(_refusal(path, unsafe))


def _refusal(path: str | os.PathLike[str], unsafe: list[str]) -> str:
    return (f"checkpoint file {path} holds pickled objects rlinf_pipe's checkpoints never contain "
            f"({', '.join(unsafe)}); loading it could run code, so it is refused. Resume only from checkpoints this "
            "project wrote, from a source you trust")
