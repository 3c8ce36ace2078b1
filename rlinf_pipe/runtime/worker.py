"""`Worker`: the base class of every rlinf_pipe process (a Ray actor placed on an exact node and GPUs).

A subclass adds methods and calls `super().__init__()` first in its constructor: that reads the placement (set in
the environment at launch, `self.info`) and, for a group launched with `distributed=True`, joins the group's
torch.distributed world, so the rest of the constructor can build models on it. `WorkerGroup.launch` starts one
actor per placed process.
"""

from __future__ import annotations

import os
import socket
import sys
from collections.abc import Sequence
from dataclasses import dataclass
from datetime import timedelta
from typing import Any, Callable, TypeVar, cast

import ray

from rlinf_pipe.errors import ClusterError
from rlinf_pipe.utils.compute_thread import ComputeThread, compute_thread
from rlinf_pipe.runtime.cores import pin_process
from rlinf_pipe.runtime.gloo_device import share_gloo_device
from rlinf_pipe.runtime.last_output import announce_output
from rlinf_pipe.utils.net import rendezvous_port, socket_interface_env
from rlinf_pipe.utils.profiling import ProfileResult, StepProfiler
from rlinf_pipe.utils.shm import small_shm_warning
from rlinf_pipe.utils import tracing
from rlinf_pipe.utils.tracing import Span, Tracer

ENV_PREFIX = "RLINF_PIPE_"
NODE_VISIBLE_ENV = f"{ENV_PREFIX}NODE_VISIBLE_DEVICES"  # the GPUs the node's Ray sees (its CUDA_VISIBLE_DEVICES)
CONTROL_GROUP = "control"  # liveness/metadata calls run in their own thread, answered while a long method runs
MASTER_ADDR_ENV = f"{ENV_PREFIX}MASTER_ADDR"
MASTER_PORT_ENV = f"{ENV_PREFIX}MASTER_PORT"
NODE_PROCS_ENV = f"{ENV_PREFIX}NODE_PROCS"  # "node:count,...": the compute processes sharing each node's CPUs


F = TypeVar("F", bound=Callable[..., Any])


def control_call(method: F) -> F:
    """Run a worker method in the worker's control thread (`CONTROL_GROUP`), answered while a long method runs
    (liveness, metadata, abandoning a step). The method keeps its signature for the type checker (the driver calls
    it through the typed verbs, `rlinf_pipe.runtime.verbs`)."""
    return cast(F, ray.method(concurrency_group=CONTROL_GROUP)(method))


def free_port_here(avoid: Sequence[int] = ()) -> tuple[str, int]:
    """This node's address and a TCP port free on it for a rendezvous, not one of `avoid`."""
    return ray.util.get_node_ip_address(), rendezvous_port(avoid=frozenset(avoid))


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
        # We choose the device ids ourselves (`claim_devices`); Ray must not overwrite them.
        "RAY_EXPERIMENTAL_NOSET_CUDA_VISIBLE_DEVICES": "1",
    }
    return env


def visible_devices(node_visible: str | None, local_gpus: tuple[int, ...]) -> str:
    """CUDA_VISIBLE_DEVICES for a process that owns the node's GPUs `local_gpus`: they index the devices the node's
    Ray exposes (its own CUDA_VISIBLE_DEVICES, e.g. "4,5,6,7" under Slurm, or GPU UUIDs), all of the node's GPUs
    when it has none."""
    if not node_visible:
        return ",".join(map(str, local_gpus))
    devices = [d.strip() for d in node_visible.split(",") if d.strip()]
    if local_gpus and max(local_gpus) >= len(devices):
        raise ClusterError(
            f"this process's placement uses the node's GPU {max(local_gpus)}, but the node's Ray sees only "
            f"{len(devices)} (CUDA_VISIBLE_DEVICES={node_visible!r} when Ray started): give cluster.num_gpus_per_node "
            "the number of GPUs Ray was started with"
        )
    return ",".join(devices[i] for i in local_gpus)


def claim_devices() -> None:
    """Restrict this process to its placement's GPUs, as indices into the GPUs its node's Ray sees (before CUDA
    starts; the node's list is kept, so calling it twice is harmless)."""
    env = os.environ
    local = _ids(env.get(f"{ENV_PREFIX}LOCAL_GPUS", ""))
    if not local:
        return
    node_visible = env.setdefault(NODE_VISIBLE_ENV, env.get("CUDA_VISIBLE_DEVICES", ""))
    env["CUDA_VISIBLE_DEVICES"] = visible_devices(node_visible, local)


NVIDIA_DEVICE = "/dev/nvidiactl"  # present where an NVIDIA driver runs


def warn_cpu_torch_on_gpus(owner: str) -> None:
    """Say on stderr when this worker, placed on GPUs of a node with an NVIDIA driver, gets no CUDA from torch (a
    CPU-only build, a build newer than the driver, or no GPU left visible) and so runs on the CPU: one setup on a
    login node without GPUs installs torch's CPU build for the whole cluster."""
    import torch

    if torch.cuda.is_available() or not os.path.exists(NVIDIA_DEVICE):
        return
    if torch.version.cuda is None:
        why = "is a CPU-only build"
    else:
        try:
            torch.cuda.init()
            why = f"(CUDA {torch.version.cuda}) sees no GPU"
        except Exception as exc:  # noqa: BLE001 (torch's reason, whatever it raised)
            why = f"(CUDA {torch.version.cuda}) cannot use the GPUs: {str(exc).strip().splitlines()[0]}"
    print(f"[rlinf_pipe] {owner}: this node has an NVIDIA driver but torch {torch.__version__} {why} "
          f"(CUDA_VISIBLE_DEVICES={os.environ.get('CUDA_VISIBLE_DEVICES', '')!r}): this worker runs on the CPU. To "
          "use the GPUs, install torch with CUDA where the job runs (`bash scripts/setup.sh` on a GPU node takes "
          "the CUDA build)", file=sys.stderr, flush=True)


def warn_small_shm(owner: str) -> None:
    """Say on stderr (the worker's log, shown by the driver) when this CUDA process's node has a /dev/shm too small
    for NCCL (`small_shm_warning`): its error when the segments run out names no cause."""
    import torch

    if torch.cuda.is_available() and (warning := small_shm_warning()):
        print(f"[rlinf_pipe] {owner}: {warning}", file=sys.stderr, flush=True)


def rendezvous_env(addr: str, port: int) -> dict[str, str]:
    """Environment variables that make the workers' constructors join one torch.distributed world."""
    return {MASTER_ADDR_ENV: addr, MASTER_PORT_ENV: str(port)}


def _ids(text: str) -> tuple[int, ...]:
    return tuple(int(x) for x in text.split(",") if x)


def read_worker_info() -> WorkerInfo:
    """This process's placement, from its environment (defaults for a process started outside a group)."""
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


def node_procs_env(node_procs: dict[int, int]) -> dict[str, str]:
    """The environment that tells a worker how many compute processes share each node's CPUs (`cpu_share`);
    OMP_NUM_THREADS=1 keeps every thread but the compute thread at one torch thread."""
    return {NODE_PROCS_ENV: ",".join(f"{node}:{n}" for node, n in sorted(node_procs.items())), "OMP_NUM_THREADS": "1"}


def read_node_procs() -> dict[int, int]:
    """`node_procs_env` read back (empty when unset: a worker launched outside the runner)."""
    text = os.environ.get(NODE_PROCS_ENV, "")
    return {int(node): int(n) for node, n in (item.split(":") for item in text.split(",") if item)}


def cpu_share(node_procs: dict[int, int], node_rank: int) -> int:
    """Torch intra-op threads for one of the `node_procs[node_rank]` compute processes that share this machine's
    CPUs (those this process may run on), at least 1; 1 when the node is not in `node_procs`."""
    procs = node_procs.get(node_rank)
    return max(1, len(os.sched_getaffinity(0)) // procs) if procs else 1


def init_distributed(rank: int, world_size: int, master_addr: str, master_port: int, timeout_s: float = 300.0) -> str:
    """Join a torch.distributed world: nccl with CUDA, gloo otherwise. Returns the backend."""
    import torch
    import torch.distributed as dist

    os.environ.update(
        MASTER_ADDR=master_addr, MASTER_PORT=str(master_port), RANK=str(rank), WORLD_SIZE=str(world_size),
        LOCAL_RANK="0",
    )
    if torch.cuda.is_available():
        torch.cuda.set_device(0)  # CUDA_VISIBLE_DEVICES holds exactly this process's GPUs
        backend = "nccl"
    else:
        torch.set_num_threads(1)  # torch work runs in the compute thread (`Worker.compute`), with the worker's share
        backend = "gloo"
        share_gloo_device()  # every group of this world is gloo: one device (one loop thread) for all of them
    dist.init_process_group(backend, rank=rank, world_size=world_size, timeout=timedelta(seconds=timeout_s))
    return backend


class Worker:
    """Base class of rlinf_pipe workers: subclass it, call `super().__init__()` first, add methods; launch it with
    `WorkerGroup.launch`. `self.info` is the placement; `self.backend` the torch.distributed backend of the
    group's world (None for a group launched with `distributed=False`); `self.tracer` records its spans for the
    timeline under `self.owner` (`<group>/<rank>`); `self.compute` runs its torch work with its share of the node's
    CPUs (docs/workers.md#cpu-threads)."""

    def __init__(self) -> None:
        constructed = tracing.now()
        announce_output()  # (first: a death while the worker builds is reported with its last output)
        claim_devices()
        self.info = read_worker_info()
        # `cluster.cores_per_gpu`: this process's GPUs' cores (None: not pinned), before any torch thread starts
        self.cores = pin_process(self.info.node_rank, self.info.local_gpus)
        os.environ.update(socket_interface_env(self.info.ip, os.environ))  # before any group (ours, Megatron's)
        self.owner = f"{self.info.group}/{self.info.rank}"  # this worker's name in locks and on the timeline
        self.tracer = Tracer(self.owner, self.info.global_gpus)
        # the launch span (`tracing.LAUNCH_SPAN`), recorded at the first `worker_info` call: the driver asks every
        # worker as it starts it, so that call runs as soon as the constructor returns
        self._launch: tuple[float, float] | None = (min(tracing.process_started(), constructed), constructed)
        self.profiler = StepProfiler()
        # Torch work runs in the process's compute thread with the worker's CPU share as intra-op threads (pinned
        # to its GPUs' cores: all of them); every other thread (this one builds the models) keeps one, so the
        # process has one OpenMP team.
        self.compute: ComputeThread = compute_thread(self._cpu_share(read_node_procs()))
        self.backend: str | None = None
        if self.info.global_gpus:
            warn_cpu_torch_on_gpus(self.owner)
            warn_small_shm(self.owner)
        addr = os.environ.get(MASTER_ADDR_ENV)
        if addr:
            self.backend = init_distributed(self.info.rank, self.info.world_size, addr,
                                            int(os.environ[MASTER_PORT_ENV]))

    @property
    def rank(self) -> int:
        return self.info.rank

    @property
    def world_size(self) -> int:
        return self.info.world_size

    @control_call
    def worker_info(self) -> WorkerInfo:
        if self._launch is not None:
            (started, constructed), self._launch, built = self._launch, None, tracing.now()
            self.tracer.add(tracing.LAUNCH_SPAN, started, built, build_s=round(built - constructed, 3))
        return self.info

    @control_call
    def ping(self) -> int:
        return os.getpid()

    @control_call
    def peak_memory(self) -> int:
        """The largest resident memory this process has held, in bytes (Linux: `getrusage`'s `ru_maxrss`)."""
        import resource

        return int(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss) * 1024

    @control_call
    def share_cpus(self, node_procs: dict[int, int]) -> int:
        """Take this node's share of CPUs among `node_procs[node]` compute processes as the compute thread's
        intra-op threads, from its next call on (the driver lends the CPUs of the stages done with a step to those
        still working, `rlinf_pipe.runner.cpu_shares`). Returns the thread count."""
        return compute_thread(self._cpu_share(node_procs)).threads

    def _cpu_share(self, node_procs: dict[int, int]) -> int:
        """The compute thread's intra-op threads: the cores of this process's GPUs when pinned (nobody lends them:
        `cluster.cores_per_gpu` turns lending off), else its share of the node's CPUs among `node_procs`."""
        if self.cores is not None and self.info.local_gpus:
            return len(self.cores)
        return cpu_share(node_procs, self.info.node_rank)

    @control_call
    def abandon_step(self) -> None:
        """Make the step calls running here end now (a peer was lost; the driver retries the step once every call
        ended, see `WorkerGroup.settle`): every channel handle this process holds is aborted, so a call waiting on
        one raises `ChannelClosed`, then `on_abandon` stops the worker's own waits. The retried step's calls pass
        new channels."""
        from rlinf_pipe.channels.channel import abort_process_handles

        abort_process_handles()
        self.on_abandon()

    def on_abandon(self) -> None:
        """Subclasses: end what else a step call may wait on (an engine's requests, a weight transfer)."""

    @control_call
    def before_stop(self) -> None:
        """The worker is about to be killed (`WorkerGroup.shutdown`), and a killed process runs no exit handler:
        release now what would be left behind. Subclasses extend it (the reward worker's pool leaves its
        forkserver's socket folder in /tmp)."""

    @control_call
    def clock(self) -> float:
        """This host's clock as its spans read it (the driver measures each host's offset from its own)."""
        return tracing.now()

    def drain_spans(self) -> list[Span]:
        """The spans this worker's `tracer` recorded since the last call (the driver collects them each step)."""
        return self.tracer.drain()

    def start_profile(self, step: int) -> None:
        """Start torch.profiler for `step` (`runner.profile_steps`; see `rlinf_pipe.utils.profiling`)."""
        self.profiler.start(step)

    def stop_profile(self) -> ProfileResult:
        """Stop the profiler; the trace (and on a GPU the memory snapshot) go back to the driver."""
        return self.profiler.stop()

    def free_port(self, avoid: Sequence[int] = ()) -> tuple[str, int]:
        """A rendezvous point this worker will listen on (`free_port_here`)."""
        return free_port_here(avoid)

    def run(self, fn: Callable[..., Any], *args: Any, **kwargs: Any) -> Any:
        """Run `fn(self, *args, **kwargs)` in this worker (for tools and tests)."""
        return fn(self, *args, **kwargs)
