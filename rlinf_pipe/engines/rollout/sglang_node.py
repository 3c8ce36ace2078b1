"""What a GPU node needs before an SGLang engine starts there, checked in one line each with the fix.

* **The driver's CUDA.** The registry's sglang 0.5.23 pulls torch 2.14.1's CUDA 13 build, `cuda-python>=13` and
  `flashinfer[cu13]`: on a node whose driver supports only CUDA 12 everything installs and torch finds no GPU (or
  sglang's kernels fail to load). `check_cuda_driver` compares the driver's CUDA version (libcuda's
  `cuDriverGetVersion`, else `nvidia-smi`) with the CUDA torch was built for and the one sglang's requirements
  name (`cuda-python`'s major), and names both.
* **The flashinfer JIT cache.** An engine's first start compiles flashinfer's kernels into flashinfer's cache
  (`$FLASHINFER_WORKSPACE_BASE/.cache/flashinfer/<version>/<archs>/cached_ops`, the home folder when unset), with a
  file lock per kernel: engines that share the folder compile each kernel once and the others wait and load it.
  A home folder on a network file system (common on clusters) shares it across nodes, whose locks are unreliable
  there. `use_node_jit_cache` gives every engine of a node one local folder (`JIT_CACHE_DIR`), unless
  `FLASHINFER_WORKSPACE_BASE` is set.

glibc (2.34 or newer: sglang ships only `manylinux_2_34` wheels) and Python (3.11 to 3.13) are checked by
`scripts/setup.sh` before it installs the `sglang` extra.
"""

from __future__ import annotations

import ctypes
import importlib.metadata
import logging
import os
import re
import shutil
import subprocess
from collections.abc import Mapping, MutableMapping
from pathlib import Path

log = logging.getLogger(__name__)

SGLANG_CUDA_MAJOR = 13
"""The CUDA major version sglang 0.5.23's requirements pull (torch 2.14.1+cu130, cuda-python>=13, flashinfer cu13),
assumed where the installed sglang's metadata names none; tests/pins check it against what the extra resolves to."""
DRIVER_FIX = {13: "an NVIDIA driver of branch R580 or newer", 12: "an NVIDIA driver of branch R525 or newer"}
JIT_CACHE_ENV = "FLASHINFER_WORKSPACE_BASE"
JIT_CACHE_DIR = Path("/var/tmp") / f"rlinf_pipe-{os.getuid()}" / "flashinfer"
"""The node-local folder every SGLang engine of this user on a node compiles flashinfer's kernels into."""

Version = tuple[int, int]


def _version(text: str | None) -> Version | None:
    match = re.match(r"(\d+)\.(\d+)", text or "")
    return (int(match[1]), int(match[2])) if match else None


def driver_cuda_version() -> Version | None:
    """The newest CUDA version the node's NVIDIA driver supports (None: no driver found)."""
    try:
        libcuda = ctypes.CDLL("libcuda.so.1")
        found = ctypes.c_int(0)
        if libcuda.cuDriverGetVersion(ctypes.byref(found)) == 0 and found.value:
            return found.value // 1000, (found.value % 1000) // 10
    except OSError:
        pass
    smi = shutil.which("nvidia-smi")
    if smi is None:
        return None
    try:
        out = subprocess.run([smi], capture_output=True, text=True, timeout=30, check=False).stdout
    except (OSError, subprocess.TimeoutExpired):
        return None
    match = re.search(r"CUDA Version:\s*(\d+\.\d+)", out)
    return _version(match[1]) if match else None


def torch_cuda() -> tuple[str, Version | None]:
    """torch's version and the CUDA version it was built for (None: a CPU build)."""
    import torch

    return torch.__version__, _version(torch.version.cuda)


def sglang_cuda_major(requirements: list[str] | None = None) -> int | None:
    """The CUDA major the installed sglang's requirements name (`cuda-python>=N`), None where it names none."""
    if requirements is None:
        try:
            requirements = importlib.metadata.requires("sglang") or []
        except importlib.metadata.PackageNotFoundError:
            return None
    for requirement in requirements:
        match = re.match(r"cuda[-_]python\s*(?:\[[^]]*\])?\s*>=\s*(\d+)", requirement.strip())
        if match:
            return int(match[1])
    return None


def cuda_driver_problem(driver: Version | None, torch_version: str, torch_built: Version | None,
                        sglang_major: int | None, sglang_version: str) -> str:
    """Why this node cannot run the installed torch and sglang on its GPUs ("" when it can), with the fix."""
    if torch_built is None:
        return (f"torch {torch_version} is a CPU-only build, so sglang {sglang_version} finds no GPU: install the "
                "sglang extra on the GPU node itself (`bash scripts/setup.sh sglang` there pulls its CUDA build)")
    if driver is None:
        return (f"no NVIDIA driver found on this node (libcuda.so.1 and nvidia-smi are missing), and torch "
                f"{torch_version} needs one for CUDA {torch_built[0]}.{torch_built[1]}: install "
                f"{DRIVER_FIX.get(torch_built[0], 'an NVIDIA driver')} or run the engines on a GPU node")
    needed = max(torch_built[0], sglang_major or 0)
    if driver[0] >= needed:
        return ""
    sglang = f" and sglang {sglang_version} needs CUDA {sglang_major} (cuda-python>={sglang_major})" if sglang_major \
        else ""
    return (f"this node's NVIDIA driver supports CUDA {driver[0]}.{driver[1]}, but torch {torch_version} was built "
            f"for CUDA {torch_built[0]}.{torch_built[1]}{sglang}: everything installs and no GPU works; install "
            f"{DRIVER_FIX.get(needed, f'a driver for CUDA {needed}')} (sglang {sglang_version} has no CUDA "
            f"{driver[0]} build)")


class NodeNotReadyError(RuntimeError):
    """The node cannot run an SGLang engine (the message names the fix)."""


def check_cuda_driver(sglang_version: str) -> None:
    """Before an engine starts: `NodeNotReadyError` when the driver is older than the CUDA of torch and sglang."""
    torch_version, built = torch_cuda()
    problem = cuda_driver_problem(driver_cuda_version(), torch_version, built,
                                  sglang_cuda_major() or SGLANG_CUDA_MAJOR, sglang_version)
    if problem:
        raise NodeNotReadyError(problem)


def use_node_jit_cache(env: MutableMapping[str, str] | None = None, folder: Path | None = None) -> str:
    """Point flashinfer's JIT cache at the node's folder (`JIT_CACHE_DIR`, made here) unless
    `FLASHINFER_WORKSPACE_BASE` is set in `env` (this process's); the folder used. Set before sglang is imported:
    flashinfer reads it when it is imported."""
    env = os.environ if env is None else env
    folder = JIT_CACHE_DIR if folder is None else folder
    if env.get(JIT_CACHE_ENV):
        return env[JIT_CACHE_ENV]
    try:
        folder.mkdir(parents=True, exist_ok=True)
    except OSError as exc:  # (flashinfer then uses the home folder, as without us)
        log.warning("cannot make the node's flashinfer JIT cache %s (%s): each engine uses its home folder's; set "
                    "%s to a writable local folder to share one", folder, exc.strerror or exc, JIT_CACHE_ENV)
        return str(Path.home())
    env[JIT_CACHE_ENV] = str(folder)
    return str(folder)


def jit_cache_of(env: Mapping[str, str]) -> Path:
    """Where flashinfer 0.7.2 keeps its cache under `env` (its `jit/env.py`)."""
    return Path(env.get(JIT_CACHE_ENV) or Path.home()) / ".cache" / "flashinfer"
