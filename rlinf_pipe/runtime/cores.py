"""Virtual GPUs pinned to cores (`cluster.cores_per_gpu`): on a CPU machine each GPU's workers run on cores of their
own, so stages on different GPUs never share a core (as stages on different devices never share a device) and a
phase on GPUs taken in turns gets every core of its GPUs.

GPU `s` of a host owns cores `allowed[s*k : (s+1)*k]`, `k` = cores_per_gpu and `allowed` the sorted cores the
worker process may use when it starts. `s` numbers the GPUs of all the job's nodes on that host in node order (one
node per host: the node's local GPU id; several Ray nodes on one machine, as in a rehearsal: across them). A
process without GPUs (a reward worker) takes the cores no GPU owns, or every allowed core when none is left.
Pure functions, and `pin_process`, which a worker calls in its constructor (`Worker.__init__`).
"""

from __future__ import annotations

import os
import socket
from collections.abc import Sequence
from dataclasses import dataclass

from rlinf_pipe.errors import ConfigError

ENV_PREFIX = "RLINF_PIPE_"
CORES_PER_GPU_ENV = f"{ENV_PREFIX}CORES_PER_GPU"
HOST_SLOTS_ENV = f"{ENV_PREFIX}HOST_SLOTS"  # "node:first_slot:host_gpus,...": each node's GPUs among its host's


@dataclass(frozen=True)
class HostSlots:
    """Where one node's GPUs sit among those of the host it runs on: the host slot of its local GPU 0, and how many
    GPUs the job uses on the whole host (every node there)."""

    first: int
    host_gpus: int


def host_slots(node_hosts: Sequence[str], gpus_per_node: Sequence[int]) -> list[HostSlots]:
    """Per node (in node order): its `HostSlots`, the GPUs of the nodes that share a host (the same address)
    numbered one after another in node order."""
    totals: dict[str, int] = {}
    firsts = []
    for host, gpus in zip(node_hosts, gpus_per_node, strict=True):
        firsts.append(totals.get(host, 0))
        totals[host] = totals.get(host, 0) + gpus
    return [HostSlots(first, totals[host]) for first, host in zip(firsts, node_hosts, strict=True)]


def check_host_cores(cores_per_gpu: int, host_gpus: int, cores: int, host: str = "this host") -> None:
    """Raise a `ConfigError` when `host_gpus` GPUs of `cores_per_gpu` cores each need more than the host's `cores`."""
    needed = host_gpus * cores_per_gpu
    if needed <= cores:
        return
    fit = cores // host_gpus
    fix = (f"set cluster.cores_per_gpu to {fit} or less" if fit else
           f"use at most {cores} GPUs on this host (cluster.num_gpus_per_node)")
    raise ConfigError(
        f"cluster.cores_per_gpu={cores_per_gpu}: the job's {host_gpus} GPU(s) on {host} need {host_gpus} x "
        f"{cores_per_gpu} = {needed} cores, but its processes may use {cores}; {fix}, or set cluster.cores_per_gpu="
        "null (no pinning: every process may use every core)"
    )


def worker_cores(allowed: Sequence[int], local_gpus: Sequence[int], slots: HostSlots, cores_per_gpu: int,
                 host: str = "this host") -> tuple[int, ...]:
    """The cores of a process on its node's GPUs `local_gpus` (none: a process without GPUs), given the cores it
    may use (`allowed`), its node's `slots` and `cores_per_gpu`; sorted. Too few cores on the host raise a
    `ConfigError` (`check_host_cores`)."""
    cores = sorted(set(allowed))
    check_host_cores(cores_per_gpu, slots.host_gpus, len(cores), host)
    k = cores_per_gpu
    if not local_gpus:
        return tuple(cores[slots.host_gpus * k:] or cores)
    return tuple(sorted(c for g in set(local_gpus) for c in cores[(slots.first + g) * k:(slots.first + g + 1) * k]))


def pinning_env(cores_per_gpu: int | None, slots: Sequence[HostSlots]) -> dict[str, str]:
    """The environment that makes each worker pin itself (`pin_process`); empty without pinning."""
    if cores_per_gpu is None:
        return {}
    return {CORES_PER_GPU_ENV: str(cores_per_gpu),
            HOST_SLOTS_ENV: ",".join(f"{node}:{s.first}:{s.host_gpus}" for node, s in enumerate(slots))}


def check_driver_host(cores_per_gpu: int | None, node_hosts: Sequence[str], gpus_per_node: Sequence[int],
                      driver_host: str | None) -> None:
    """Before launching: the GPUs of the job's nodes on the driver's host (`driver_host`, None: on none of them)
    need at most the cores this process may use (a worker checks its own host again as it starts)."""
    if cores_per_gpu is None or driver_host is None:
        return
    host_gpus = sum(g for h, g in zip(node_hosts, gpus_per_node, strict=True) if h == driver_host)
    check_host_cores(cores_per_gpu, host_gpus, len(os.sched_getaffinity(0)), f"host {driver_host}")


def read_pinning(node_rank: int) -> tuple[int, HostSlots] | None:
    """`pinning_env` read back for node `node_rank`: cores per GPU and the node's slots (None: no pinning)."""
    k = os.environ.get(CORES_PER_GPU_ENV)
    if not k:
        return None
    for item in os.environ.get(HOST_SLOTS_ENV, "").split(","):
        node, first, total = item.split(":")
        if int(node) == node_rank:
            return int(k), HostSlots(int(first), int(total))
    raise ValueError(f"{HOST_SLOTS_ENV} has no entry for node {node_rank}: {os.environ.get(HOST_SLOTS_ENV)!r}")


def set_process_affinity(cores: Sequence[int]) -> None:
    """Pin every thread of this process to `cores` (a thread inherits its creator's cores, and Ray's threads that
    exist already start the process's later threads: pinning the calling thread alone would not hold)."""
    done: set[int] = set()
    while True:  # again until no thread started meanwhile
        tids = {int(t) for t in os.listdir("/proc/self/task")} - done
        if not tids:
            return
        for tid in tids:
            try:
                os.sched_setaffinity(tid, cores)
            except ProcessLookupError:  # (the thread ended meanwhile)
                pass
        done |= tids


def pin_process(node_rank: int, local_gpus: Sequence[int]) -> tuple[int, ...] | None:
    """Pin this process to its GPUs' cores when the job pins (`pinning_env` in its environment); returns them, or
    None without pinning. Call it before any torch thread starts."""
    pinning = read_pinning(node_rank)
    if pinning is None:
        return None
    cores = worker_cores(sorted(os.sched_getaffinity(0)), local_gpus, pinning[1], pinning[0],
                         f"host {socket.gethostname()}")
    set_process_affinity(cores)
    return cores
