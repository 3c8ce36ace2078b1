"""Building an `sglang.Engine` for `SGLangEngine`: the package (or a stand-in, for tests), its server arguments,
and the thread that builds it and lives as long as it does (`EngineThread`)."""

from __future__ import annotations

import concurrent.futures
import importlib
import os
import resource
import socket
import threading
from collections.abc import Mapping
from types import SimpleNamespace
from typing import Any

from rlinf_pipe.utils.logs import logging_kept

SGLANG_VERSION = "0.5.23"
"""The sglang release this adapter was written and contract-tested against."""

INSTALL_HINT = "pip install 'rlinf_pipe[sglang]'"


class SGLangNotInstalledError(ImportError):
    """sglang is missing (it installs and runs only on a machine with a CUDA GPU)."""


STANDIN_ENV = "RLINF_PIPE_SGLANG_MODULE"
"""For tests: the import name of a module with `Engine` and `io_struct` to use instead of sglang's."""


def import_sglang() -> Any:
    """The `sglang` API this adapter uses (`Engine` and `io_struct`), or `SGLangNotInstalledError`; the real one
    only on a node whose NVIDIA driver runs the CUDA it was built for (`sglang_node.check_cuda_driver`)."""
    standin = os.environ.get(STANDIN_ENV)
    if standin:
        return importlib.import_module(standin)
    try:
        import sglang
        from sglang.srt.managers import io_struct
    except ImportError as e:
        raise SGLangNotInstalledError(
            f"rollout.backend 'sglang' needs the sglang package (=={SGLANG_VERSION}), which needs a CUDA GPU: "
            f"{INSTALL_HINT}. On a CPU-only machine use rollout.backend 'torch'."
        ) from e
    from rlinf_pipe.engines.rollout.sglang_node import check_cuda_driver

    check_cuda_driver(SGLANG_VERSION)
    return SimpleNamespace(Engine=sglang.Engine, io_struct=io_struct)


NCCL_PORT_BASE = 22000
"""sglang 0.5.23 draws the port of an engine's torch.distributed store at random from 22000-29999
(`get_free_port_below_ephemeral`), so engines started at once on one node can draw the same one, and all but one
fail to start. Each engine takes this base plus its first GPU's index on the node instead (`nccl_port_for`)."""


def nccl_port_for(first_gpu: int | None) -> int | None:
    """The torch.distributed port of the engine whose first GPU is `first_gpu` (index on its node), if free now;
    None (sglang draws one) without a GPU index or when another process listens there. Connections a killed engine
    left in TIME_WAIT on it do not count (`SO_REUSEADDR`, as sglang's own check and torch's store bind): else a
    relaunched engine would draw at random, the clash this port avoids."""
    if first_gpu is None:
        return None
    port = NCCL_PORT_BASE + first_gpu
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:  # (IPv4: the store binds that side, as sglang
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)    # checks it)
        try:
            sock.bind(("0.0.0.0", port))
        except OSError:
            return None
    return port


def server_args(model_path: str, *, tp_size: int, mem_fraction_static: float, max_running_requests: int | None,
                seed: int, deterministic: bool, dtype: str, cpu_backup: bool,
                nccl_port: int | None = None) -> dict[str, Any]:
    """The Engine's keyword arguments (sglang `ServerArgs` fields); `nccl_port` None: sglang draws one."""
    for name, value, low in (("tp_size", tp_size, 1), ("max_running_requests", max_running_requests or 1, 1)):
        if value < low:
            raise ValueError(f"{name} must be >= {low}, got {value}")
    if not 0.0 < mem_fraction_static < 1.0:
        raise ValueError(f"mem_fraction_static must be in (0, 1), got {mem_fraction_static}")
    args: dict[str, Any] = {
        "model_path": model_path, "tp_size": tp_size, "mem_fraction_static": mem_fraction_static,
        "random_seed": seed, "dtype": dtype,
        "skip_tokenizer_init": True,  # token ids in and out; the adapter decodes
        "enable_memory_saver": True,  # release / resume_memory_occupation
        "enable_weights_cpu_backup": cpu_backup,
        "enable_deterministic_inference": deterministic,
        "log_level": "error",
    }
    if max_running_requests is not None:
        args["max_running_requests"] = max_running_requests
    if nccl_port is not None:
        args["nccl_port"] = nccl_port
    return args


MIB = 1 << 20
GIB = 1 << 30

ALLOC_CONF = "PYTORCH_CUDA_ALLOC_CONF"


def without_expandable_segments(conf: str) -> str:
    """`PYTORCH_CUDA_ALLOC_CONF` without `expandable_segments`, which sglang's memory saver (torch_memory_saver)
    refuses in the scheduler processes that inherit it (a common setting for Megatron, so workers may get it)."""
    kept = [o for o in conf.split(",") if o.strip() and o.split(":")[0].strip() != "expandable_segments"]
    return ",".join(kept)


CORE_DUMPS_ENV = "RLINF_PIPE_CORE_DUMPS"
"""Set to 1 to keep core dumps in processes that run an SGLang engine (`no_core_dumps`)."""


def no_core_dumps(env: Mapping[str, str] = os.environ) -> bool:
    """Turn core dumps off in this process (and the engine processes it starts), unless `RLINF_PIPE_CORE_DUMPS=1`;
    returns whether it did. sglang's scheduler and watchdog end the engine's process with SIGQUIT when they fail,
    and only an engine built in the main thread installs sglang's handler for it: ours is built in a thread
    (`EngineThread`), so SIGQUIT's default action would write a core file of a process holding a CUDA context and
    the engine's mappings where `ulimit -c` allows, while the worker's loss waits for the write."""
    if env.get(CORE_DUMPS_ENV) == "1":
        return False
    soft, hard = resource.getrlimit(resource.RLIMIT_CORE)
    if soft == 0:
        return False
    resource.setrlimit(resource.RLIMIT_CORE, (0, hard))
    return True


class EngineThread:
    """Builds the Engine in a thread of its own, with no running event loop (the Engine captures a loop of its own
    there, never used), and keeps that thread alive until `close`: sglang's scheduler and detokenizer processes ask
    the kernel to kill them when their parent dies (`PR_SET_PDEATHSIG`), and on Linux their parent is the thread
    that started them, not the process. (A thread that ended after building left an Engine whose processes were
    already killed.) When this process dies, they die with it."""

    def __init__(self, factory: Any, args: dict[str, Any]):
        self._built: concurrent.futures.Future = concurrent.futures.Future()
        self._closed = threading.Event()
        self._thread = threading.Thread(target=self._run, args=(factory, args), name="sglang-engine", daemon=True)
        self._thread.start()
        self.engine = self._built.result()

    def _run(self, factory: Any, args: dict[str, Any]) -> None:
        try:
            with logging_kept():  # (sglang resets the root logger to its log_level)
                engine = factory(**args)
        except BaseException as exc:  # (handed to the constructor's caller)
            self._built.set_exception(exc)
            return
        self._built.set_result(engine)
        self._closed.wait()

    def close(self) -> None:
        """Let the thread end (after the Engine's shutdown: its processes would be killed with the thread)."""
        self._closed.set()
        self._thread.join()
