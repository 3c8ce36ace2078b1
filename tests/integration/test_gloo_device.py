"""`share_gloo_device`: the gloo groups of a process share one device, so one TCP loop thread serves them all, and
collectives on each group still add up (two real processes, a world and three more groups, two of them subgroups)."""

from __future__ import annotations

import os
import socket

import pytest
import torch.multiprocessing as mp

GROUPS = 3


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _rank(rank: int, port: int, shared: bool, out: dict) -> None:
    import torch
    import torch.distributed as dist

    from rlinf_pipe.runtime.gloo_device import gloo_loop_threads, share_gloo_device

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    if shared:
        share_gloo_device()
        share_gloo_device()  # (idempotent)
    dist.init_process_group("gloo", rank=rank, world_size=2)
    both = [dist.new_group([0, 1], backend="gloo") for _ in range(GROUPS - 1)]
    alone = [dist.new_group([0]), dist.new_group([1])]  # (every rank makes every group, in one order)
    groups = [*both, alone[rank]]
    sums = []
    for group in [None, *groups]:
        t = torch.tensor([rank + 1.0])
        dist.all_reduce(t, group=group)
        sums.append(t.item())
    out[rank] = (sums, gloo_loop_threads())
    dist.barrier()
    dist.destroy_process_group()


@pytest.mark.parametrize("shared", [True, False])
def test_groups_share_one_loop_thread(shared):
    ctx = mp.get_context("spawn")
    out = ctx.Manager().dict()
    port = _free_port()
    procs = [ctx.Process(target=_rank, args=(r, port, shared, out)) for r in range(2)]
    for p in procs:
        p.start()
    for p in procs:
        p.join(120)
        assert p.exitcode == 0
    for rank in (0, 1):
        sums, loops = out[rank]
        assert sums == [3.0, 3.0, 3.0, rank + 1.0]  # the world, two groups of both ranks, a group of one
        # (without sharing: a device, so a loop thread, per group this rank is in)
        assert loops == 1 if shared else loops > 1
