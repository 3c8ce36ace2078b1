"""Rendezvous points the driver hands out: an address and a port for a torch.distributed store (a group's world, a
weight route's process group), drawn so that two drawn before either binds never share a port."""

from __future__ import annotations

from collections import deque
from typing import Any

import ray
from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

from rlinf_pipe.runtime.worker import free_port_here


_HANDED_OUT: deque[int] = deque(maxlen=64)  # the ports of the rendezvous points this driver handed out last


def handed_out_ports() -> list[int]:
    """The ports of the rendezvous points this driver handed out lately, which a new draw avoids: every rendezvous it
    arranges draws its port before any of them is bound (groups started together, the weight routes of one open),
    so a port free at each draw could be drawn twice (the second store then fails to bind)."""
    return list(_HANDED_OUT)


def hand_out(point: tuple[str, int]) -> tuple[str, int]:
    """Record `point` (address, port), drawn avoiding `handed_out_ports()`, as handed out; returns it."""
    _HANDED_OUT.append(point[1])
    return point


def rendezvous_point(node: Any) -> tuple[str, int]:
    """An address and a free port on `node` for a group's torch.distributed rendezvous, not one handed out lately:
    found here when the driver runs on that node, else by a probe task there (a worker process of its own:
    seconds)."""
    avoid = handed_out_ports()
    if node.node_id == ray.get_runtime_context().get_node_id():
        return hand_out(free_port_here(avoid))
    probe = ray.remote(num_cpus=0)(free_port_here).options(
        scheduling_strategy=NodeAffinitySchedulingStrategy(node.node_id, soft=False))
    # (Ray's stubs type a remote function by its parameter count, not counting one with a default: `avoid`)
    addr, port = ray.get(probe.remote(avoid))  # type: ignore[call-arg]
    return hand_out((addr, port))
