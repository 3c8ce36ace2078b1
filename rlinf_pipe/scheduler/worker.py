"""`Worker`: the base class of every rlinf_pipe process (a Ray actor placed on an exact node and GPUs).

A subclass adds methods; `WorkerGroup.launch` starts one actor per placed process. The placement reaches the
process through environment variables set at launch, so it is known inside `__init__` already (`self.info`).
"""

from __future__ import annotations

import os
import socket
from dataclasses import dataclass
from typing import Any, Callable

import ray

from rlinf_pipe.utils.net import free_port

ENV_PREFIX = "RLINF_PIPE_"
CONTROL_GROUP = "control"  # liveness/metadata calls run in their own thread, answered while a long method runs


@dataclass(frozen=True)
class WorkerInfo:
    """Where a worker runs and who it is in its group."""

    group: str
    rank: int
    world_size: int
    node_rank: int
    local_gpus: tuple[int, ...]
    global_gpus: tuple[int, ...]
    hostname: str
    ip: str
    pid: int
    node_id: str
    cuda_visible_devices: str | None


def placement_env(group: str, rank: int, world_size: int, node_rank: int, local_gpus, global_gpus) -> dict[str, str]:
    """Environment variables that carry a process's placement into its Ray actor."""
    env = {
        f"{ENV_PREFIX}GROUP": group,
        f"{ENV_PREFIX}RANK": str(rank),
        f"{ENV_PREFIX}WORLD_SIZE": str(world_size),
        f"{ENV_PREFIX}NODE_RANK": str(node_rank),
        f"{ENV_PREFIX}LOCAL_GPUS": ",".join(map(str, local_gpus)),
        f"{ENV_PREFIX}GLOBAL_GPUS": ",".join(map(str, global_gpus)),
        # We choose the device ids ourselves; Ray must not overwrite them.
        "RAY_EXPERIMENTAL_NOSET_CUDA_VISIBLE_DEVICES": "1",
    }
    if local_gpus:
        env["CUDA_VISIBLE_DEVICES"] = ",".join(map(str, local_gpus))
    return env


def _ids(text: str) -> tuple[int, ...]:
    return tuple(int(x) for x in text.split(",") if x)


class Worker:
    """Base class of rlinf_pipe workers. Subclass it and add methods; launch it with `WorkerGroup.launch`."""

    @property
    def info(self) -> WorkerInfo:
        env = os.environ
        return WorkerInfo(
            group=env.get(f"{ENV_PREFIX}GROUP", "standalone"),
            rank=int(env.get(f"{ENV_PREFIX}RANK", 0)),
            world_size=int(env.get(f"{ENV_PREFIX}WORLD_SIZE", 1)),
            node_rank=int(env.get(f"{ENV_PREFIX}NODE_RANK", 0)),
            local_gpus=_ids(env.get(f"{ENV_PREFIX}LOCAL_GPUS", "")),
            global_gpus=_ids(env.get(f"{ENV_PREFIX}GLOBAL_GPUS", "")),
            hostname=socket.gethostname(),
            ip=ray.util.get_node_ip_address(),
            pid=os.getpid(),
            node_id=ray.get_runtime_context().get_node_id(),
            cuda_visible_devices=env.get("CUDA_VISIBLE_DEVICES"),
        )

    @property
    def rank(self) -> int:
        return int(os.environ.get(f"{ENV_PREFIX}RANK", 0))

    @property
    def world_size(self) -> int:
        return int(os.environ.get(f"{ENV_PREFIX}WORLD_SIZE", 1))

    @ray.method(concurrency_group=CONTROL_GROUP)
    def worker_info(self) -> WorkerInfo:
        return self.info

    @ray.method(concurrency_group=CONTROL_GROUP)
    def ping(self) -> int:
        return os.getpid()

    def drain_spans(self) -> list:
        """The spans this worker's `tracer` recorded since the last call (the driver collects them each step);
        none for a worker without one."""
        tracer = getattr(self, "tracer", None)
        return tracer.drain() if tracer is not None else []

    def free_port(self) -> tuple[str, int]:
        """An address and a free TCP port on this node (the rendezvous point when this is rank 0)."""
        return ray.util.get_node_ip_address(), free_port("")

    def init_distributed(self, master_addr: str, master_port: int, timeout_s: float = 300.0) -> str:
        """Join the group's torch.distributed process group: nccl with CUDA, gloo otherwise. Returns the backend."""
        from datetime import timedelta

        import torch
        import torch.distributed as dist

        os.environ.update(
            MASTER_ADDR=master_addr,
            MASTER_PORT=str(master_port),
            RANK=str(self.rank),
            WORLD_SIZE=str(self.world_size),
            LOCAL_RANK="0",
        )
        if torch.cuda.is_available():
            torch.cuda.set_device(0)  # CUDA_VISIBLE_DEVICES holds exactly this process's GPUs
            backend = "nccl"
        else:
            torch.set_num_threads(max(1, int(os.environ.get("OMP_NUM_THREADS", 1))))
            backend = "gloo"
        dist.init_process_group(
            backend, rank=self.rank, world_size=self.world_size, timeout=timedelta(seconds=timeout_s)
        )
        return backend

    def run(self, fn: Callable[..., Any], *args: Any, **kwargs: Any) -> Any:
        """Run `fn(self, *args, **kwargs)` in this worker (for tools and tests)."""
        return fn(self, *args, **kwargs)
