"""Megatron-core on CPU with 2 gloo processes: DP=2 + distributed optimizer, PP=2 (TP=2 against a single
process: tests/integration/test_actor_trainer.py, through the policy that uses these patches).

Each case spawns fresh processes (torch.multiprocessing, spawn) that talk over a TCP store
on 127.0.0.1; rlinf_pipe.models.megatron_cpu makes megatron-core's CUDA-only call sites
use the CPU.
"""

from __future__ import annotations

import os

import pytest
import torch
import torch.multiprocessing as mp
from support.megatron_train import train_tiny_gpt

from rlinf_pipe.utils.net import free_port

pytestmark = pytest.mark.slow

STEPS = 4


def _worker(rank: int, world: int, port: int, case: dict, result_dir: str) -> None:
    torch.set_num_threads(1)
    torch.distributed.init_process_group(
        "gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world
    )
    try:
        result = train_tiny_gpt(**case)
        torch.save(result, os.path.join(result_dir, f"rank{rank}.pt"))
    finally:
        from megatron.core import parallel_state

        parallel_state.destroy_model_parallel()
        torch.distributed.destroy_process_group()


def _run(world: int, case: dict, tmp_path) -> list[dict]:
    tmp_path.mkdir(parents=True, exist_ok=True)
    mp.spawn(_worker, args=(world, free_port(), case, str(tmp_path)), nprocs=world, join=True)
    return [torch.load(tmp_path / f"rank{r}.pt") for r in range(world)]


def test_dp2_distributed_optimizer_keeps_ranks_identical(tmp_path):
    r0, r1 = _run(2, dict(tp=1, pp=1, dist_opt=True, num_micro=1, steps=STEPS), tmp_path)
    assert r0["losses"][-1] < r0["losses"][0]
    assert r0["losses"] != r1["losses"]  # different data per DP rank
    assert r0["params"].keys() == r1["params"].keys()
    for name, p in r0["params"].items():
        assert torch.equal(p, r1["params"][name]), name


def test_pp2_two_microbatches_trains(tmp_path):
    r0, r1 = _run(2, dict(tp=1, pp=2, dist_opt=False, num_micro=2, steps=STEPS), tmp_path)
    assert r0["losses"] == []  # only the last stage sees the loss
    assert len(r1["losses"]) == STEPS
    assert r1["losses"][-1] < r1["losses"][0]
