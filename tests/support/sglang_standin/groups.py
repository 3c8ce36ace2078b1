"""How the stand-in's TP ranks meet a weight-update group as sglang 0.5.23's do: torch's rendezvous, a `PrefixStore`
named after the group and `_new_process_group_helper` (`init_custom_process_group`), and one broadcast of a
flattened bucket per call."""

from __future__ import annotations

from datetime import timedelta
from typing import Any

import torch


def _receive_broadcast(group: Any, buffer: torch.Tensor, registered: bool) -> None:
    """One TP rank's receive of a flattened bucket: `torch.distributed.broadcast(..., src=0, group=...)` as sglang
    does, on the group it registered (the other ranks' groups are bare backends)."""
    import torch.distributed as dist

    if registered:
        dist.broadcast(buffer, src=0, group=group, async_op=True).wait()
    else:
        group.broadcast(buffer, 0).wait()


def _join_as_sglang(address: str, port: int, rank: int, world_size: int, group_name: str, backend: str,
                    registered: bool) -> Any:
    """sglang's `init_custom_process_group`: torch's TCP rendezvous, `PrefixStore(group_name, store)`, then
    `_new_process_group_helper` (whose own prefixes `registered=False` spells out, for a second member in one
    process)."""
    import torch.distributed as dist
    from torch.distributed.distributed_c10d import Backend, _new_process_group_helper, _world, rendezvous

    timeout = timedelta(seconds=120)
    store, rank, world_size = next(rendezvous(f"tcp://{address}:{port}", rank, world_size, timeout=timeout))
    store.set_timeout(timeout)
    store = dist.PrefixStore(group_name, store)
    if not registered:
        device = "cuda" if backend == "nccl" else "cpu"
        return dist.ProcessGroupGloo(dist.PrefixStore(f"{device}/", dist.PrefixStore(f"{group_name}/", store)), rank,
                                     world_size, timeout)
    group, _ = _new_process_group_helper(world_size, rank, [], Backend(backend), store, group_name=group_name,
                                         backend_options=None, timeout=timeout)
    _world.pg_group_ranks[group] = {i: i for i in range(world_size)}
    return group
