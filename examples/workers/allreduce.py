"""Launch a worker group from a placement and all-reduce across it (runs on a CPU laptop with virtual GPUs).

    python examples/workers/allreduce.py                 # 4 virtual GPUs, actor TP 2 -> 2 data-parallel replicas
    python examples/workers/allreduce.py cluster.num_gpus_per_node=8 'cluster.component_placement={rollout: 0-3, actor: 4-7}'
"""

from __future__ import annotations

import sys

from rlinf_pipe.cli import exit_on_user_error
from rlinf_pipe.config import load_config
from rlinf_pipe.runtime.cluster import Cluster
from rlinf_pipe.planning.placement import plan_placement
from rlinf_pipe.runtime.worker import Worker
from rlinf_pipe.runtime.worker_group import WorkerGroup


class SumWorker(Worker):
    """Adds its rank into a tensor shared by the whole group."""

    def all_reduce_rank(self) -> float:
        import torch
        import torch.distributed as dist

        value = torch.tensor([float(self.rank)])
        dist.all_reduce(value)
        return value.item()

    def count(self, shard: list[int]) -> int:
        return len(shard)


def main(overrides: list[str]) -> None:
    cfg = load_config(overrides=[
        "cluster.num_gpus_per_node=4",
        "cluster.component_placement={rollout: 0-1, actor: 2-3}",
        "actor.tensor_parallel_size=1",
        *overrides,
    ])
    cluster = Cluster(cfg)
    try:
        placement = plan_placement(cfg, cluster.gpus_per_node)
        actor = WorkerGroup.launch(SumWorker, "actor", placement.components["actor"], cluster)
        for info in actor.infos():
            print(f"actor rank {info.rank}: node {info.node_rank} ({info.ip}), pid {info.pid}, "
                  f"CUDA_VISIBLE_DEVICES={info.cuda_visible_devices}, global GPUs {list(info.global_gpus)}")
        print("all-reduce of ranks:", actor.all.call(SumWorker.all_reduce_rank).wait())
        print("items per data-parallel replica:", actor.sharded.call(SumWorker.count, list(range(10))).wait())
    finally:
        cluster.shutdown()


if __name__ == "__main__":
    sys.exit(exit_on_user_error(main, sys.argv[1:]))
