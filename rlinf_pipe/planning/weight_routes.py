"""Which actor rank sends weight versions to which receivers, decided from the placement.

A sender is a gathering rank of the actor (tensor rank 0 of pipeline stage 0 of a replica: it yields the whole
replica's HF weights). `broadcast` and `object_store` have one sender, the actor's rank 0, for every receiver.
`ipc` hands out CUDA IPC handles, which open only in a process that sees the GPU holding the memory, and each
process sees only its own GPUs: every receiver takes the gathering rank that shares one of its GPUs (collocated
with an actor tensor-parallel size of 1, or an engine spanning its sender's GPU), and one with none cannot use it.
On CPU the same rule holds (shared memory would reach further), so a placement that works there works on GPUs.

GPUs are told apart by the device they are (`gpu_devices`): each placement GPU its own, unless a one-node job puts
several on one physical GPU (`RLINF_PIPE_NODE_VISIBLE_DEVICES=0,0`: the GPU suite's pipeline on a machine with one
GPU). Such GPUs count as one for both rules: NCCL refuses two ranks on a device, and an IPC handle opens there.
"""

from __future__ import annotations

import os
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass

from rlinf_pipe.errors import ConfigError
from rlinf_pipe.planning.placement import ComponentPlacement, Placement
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


NODE_DEVICES_ENV = "RLINF_PIPE_NODE_VISIBLE_DEVICES"
"""The devices the node's placement GPUs index (`runtime.worker.NODE_VISIBLE_ENV`, which the workers read too)."""
Devices = Mapping[int, str]


def gpu_devices(components: Iterable[ComponentPlacement], env: Mapping[str, str] = os.environ) -> dict[int, str]:
    """The device of each placement GPU where a one-node job (these `components`) names them (`NODE_DEVICES_ENV`,
    e.g. `0,0`: two GPUs of the placement on physical GPU 0); empty (every GPU a device of its own) otherwise."""
    named = [d.strip() for d in env.get(NODE_DEVICES_ENV, "").split(",") if d.strip()]
    processes = [p for comp in components for p in comp.processes]
    if not named or any(p.node_rank != 0 for p in processes):
        return {}
    return dict(enumerate(named))


def _on(gpus: Sequence[int], devices: Devices) -> set[str]:
    return {devices.get(gpu, f"gpu{gpu}") for gpu in gpus}


def ipc_sender(actor: ComponentPlacement, gpus: Sequence[int], devices: Devices = {}) -> int | None:
    """The gathering rank that `ipc` serves a receiver on `gpus` from: the first on one of their devices, or
    None."""
    return next((r for r in gathering_ranks(actor) if _on(actor.processes[r].global_gpus, devices) & _on(gpus, devices)),
                None)


def ipc_unreachable(placement: Placement, receivers: Sequence[str], devices: Devices = {}) -> str | None:
    """Why `ipc` cannot reach every receiver (one that shares no GPU with a gathering rank), or None."""
    comps = placement.components
    for name in receivers:
        for proc in comps[name].processes:
            if ipc_sender(comps["actor"], proc.global_gpus, devices) is None:
                gpus = ",".join(map(str, proc.global_gpus))
                return (f"{name} rank {proc.rank} (GPU {gpus}) shares no GPU with an actor rank that holds a whole "
                        "replica's weights (tensor rank 0 of pipeline stage 0), and a CUDA IPC handle opens only in a "
                        "process that sees the sender's GPU")
    return None


def gpu_shared_in_group(actor: ComponentPlacement, receivers: Mapping[str, ComponentPlacement],
                        devices: Devices = {}) -> str | None:
    """Two members of the `broadcast` group (the actor's rank 0 and every receiver) on one GPU, named, or None.
    NCCL refuses a group with two ranks on one GPU ("Duplicate GPU detected"), so on GPUs `broadcast` cannot serve
    them."""
    seen: dict[str, str] = {device: "actor rank 0" for device in _on(actor.processes[0].global_gpus, devices)}
    for name, component in receivers.items():
        for proc in component.processes:
            for gpu in proc.global_gpus:
                device = devices.get(gpu, f"gpu{gpu}")
                if device in seen:
                    where = f"GPU {gpu}" if gpu not in devices else f"GPU {gpu} (device {device})"
                    return f"{seen[device]} and {name} rank {proc.rank} are both on {where}"
                seen[device] = f"{name} rank {proc.rank}"
    return None


def weight_routes(placement: Placement, transport: Transport, receivers: Sequence[str],
                  devices: Devices = {}) -> list[WeightRoute]:
    """The routes of `transport` to the `receivers` components (see the module docstring)."""
    comps = placement.components
    everyone = tuple((name, proc.rank) for name in receivers for proc in comps[name].processes)
    if transport != "ipc":
        return [WeightRoute(0, everyone)]
    reason = ipc_unreachable(placement, receivers, devices)
    if reason is not None:
        raise ConfigError(f"runner.weight_sync: ipc needs each receiver on the GPU of an actor rank that sends: "
                          f"{reason}. Use auto (it takes object_store here).")
    routes: dict[int, list[tuple[str, int]]] = {}
    for name, rank in everyone:
        sender = ipc_sender(comps["actor"], comps[name].processes[rank].global_gpus, devices)
        assert sender is not None  # (ipc_unreachable found none unserved)
        routes.setdefault(sender, []).append((name, rank))
    return [WeightRoute(sender, tuple(members)) for sender, members in sorted(routes.items())]
