"""Which actor rank sends weight versions to which receivers, decided from the placement.

A sender is a gathering rank of the actor (tensor rank 0 of pipeline stage 0 of a replica: it yields the whole
replica's HF weights). `broadcast` and `object_store` have one sender, the actor's rank 0, for every receiver.
`ipc` hands out CUDA IPC handles, which open only in a process that sees the GPU holding the memory, and each
process sees only its own GPUs: every receiver takes the gathering rank that shares one of its GPUs (collocated
with an actor tensor-parallel size of 1, or an engine spanning its sender's GPU), and one with none cannot use it.
On CPU the same rule holds (shared memory would reach further), so a placement that works there works on GPUs.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass

from rlinf_pipe.errors import ConfigError
from rlinf_pipe.scheduler.placement import ComponentPlacement, Placement
from rlinf_pipe.weights.transport_names import Transport


@dataclass(frozen=True)
class WeightRoute:
    """One sender (an actor rank) and its receivers (component name, rank), in group-rank order."""

    sender: int
    receivers: tuple[tuple[str, int], ...]


def gathering_ranks(actor: ComponentPlacement) -> list[int]:
    """The actor ranks that hold a whole replica's weights once gathered: tensor rank 0 of pipeline stage 0, of
    every context-parallel rank (each holds the whole weights) (Megatron's rank order: tensor-parallel fastest, then
    context-parallel, then data-parallel, then pipeline)."""
    tp, cp = (1, 1) if actor.gpus_per_process > 1 else (actor.tp, actor.cp)
    return [p.rank for p in actor.processes if p.rank % tp == 0 and p.rank < tp * cp * actor.dp]


def ipc_sender(actor: ComponentPlacement, gpus: Sequence[int]) -> int | None:
    """The gathering rank that `ipc` serves a receiver on `gpus` from: the first on one of them, or None."""
    return next((r for r in gathering_ranks(actor) if set(actor.processes[r].global_gpus) & set(gpus)), None)


def ipc_unreachable(placement: Placement, receivers: Sequence[str]) -> str | None:
    """Why `ipc` cannot reach every receiver (one that shares no GPU with a gathering rank), or None."""
    comps = placement.components
    for name in receivers:
        for proc in comps[name].processes:
            if ipc_sender(comps["actor"], proc.global_gpus) is None:
                gpus = ",".join(map(str, proc.global_gpus))
                return (f"{name} rank {proc.rank} (GPU {gpus}) shares no GPU with an actor rank that holds a whole "
                        "replica's weights (tensor rank 0 of pipeline stage 0), and a CUDA IPC handle opens only in a "
                        "process that sees the sender's GPU")
    return None


def gpu_shared_in_group(actor: ComponentPlacement, receivers: Mapping[str, ComponentPlacement]) -> str | None:
    """Two members of the `broadcast` group (the actor's rank 0 and every receiver) on one GPU, named, or None.
    NCCL refuses a group with two ranks on one GPU ("Duplicate GPU detected"), so on GPUs `broadcast` cannot serve
    them."""
    seen: dict[int, str] = {gpu: "actor rank 0" for gpu in actor.processes[0].global_gpus}
    for name, component in receivers.items():
        for proc in component.processes:
            for gpu in proc.global_gpus:
                if gpu in seen:
                    return f"{seen[gpu]} and {name} rank {proc.rank} are both on GPU {gpu}"
                seen[gpu] = f"{name} rank {proc.rank}"
    return None


def weight_routes(placement: Placement, transport: Transport, receivers: Sequence[str]) -> list[WeightRoute]:
    """The routes of `transport` to the `receivers` components (see the module docstring)."""
    comps = placement.components
    everyone = tuple((name, proc.rank) for name in receivers for proc in comps[name].processes)
    if transport != "ipc":
        return [WeightRoute(0, everyone)]
    reason = ipc_unreachable(placement, receivers)
    if reason is not None:
        raise ConfigError(f"runner.weight_sync: ipc needs each receiver on the GPU of an actor rank that sends: "
                          f"{reason}. Use auto (it takes object_store here).")
    routes: dict[int, list[tuple[str, int]]] = {}
    for name, rank in everyone:
        sender = ipc_sender(comps["actor"], comps[name].processes[rank].global_gpus)
        assert sender is not None  # (ipc_unreachable found none unserved)
        routes.setdefault(sender, []).append((name, rank))
    return [WeightRoute(sender, tuple(members)) for sender, members in sorted(routes.items())]
