"""`cluster.cores_per_gpu` on a real Ray cluster: two Ray nodes of one virtual GPU each on this machine, one core a
GPU. Every thread of each GPU's worker runs on that GPU's core (the two nodes' GPUs numbered across the host), its
torch threads are its cores, and a worker without GPUs takes the cores left over (every core when none is)."""

from __future__ import annotations

import os
import sys

import pytest
import ray
from ray.cluster_utils import Cluster as RayTestCluster

from rlinf_pipe.config import Config
from rlinf_pipe.planning.placement import plan_placement, reward_placement
from rlinf_pipe.runner.cpu_shares import core_pinning
from rlinf_pipe.runtime.cluster import NODE_RANK_LABEL, Cluster
from rlinf_pipe.runtime.worker import Worker
from rlinf_pipe.runtime.worker_group import WorkerGroup

ray.cloudpickle.register_pickle_by_value(sys.modules[__name__])  # (the tests folder is not importable in Ray)

ALLOWED = sorted(os.sched_getaffinity(0))


class CoreProbe(Worker):
    def cores(self) -> dict[str, list[int]]:
        """The cores every thread of this process may run on, by where they were read."""
        import torch

        def in_compute() -> tuple[list[int], int]:
            return sorted(os.sched_getaffinity(0)), torch.get_num_threads()

        compute, threads = self.compute.call(in_compute)
        every = sorted({c for tid in os.listdir("/proc/self/task") for c in os.sched_getaffinity(int(tid))})
        return {"method": sorted(os.sched_getaffinity(0)), "compute": compute, "every_thread": every,
                "torch_threads": [threads], "pinned": sorted(self.cores or ())}


def config() -> Config:
    cfg = Config()
    cfg.cluster.num_nodes, cfg.cluster.num_gpus_per_node, cfg.cluster.cores_per_gpu = 2, 1, 1
    cfg.cluster.component_placement = {"actor,rollout": "0-1"}  # collocated: rank r of each on GPU r
    return cfg


@pytest.fixture(scope="module")
def cluster():
    if len(ALLOWED) < 2:
        pytest.skip("needs 2 cores")
    test_cluster = RayTestCluster(initialize_head=True, head_node_args={"num_cpus": 1, "num_gpus": 1})
    test_cluster.add_node(num_cpus=1, num_gpus=1, labels={NODE_RANK_LABEL: "1"})
    ray.init(address=test_cluster.address)
    try:
        yield Cluster(config())
    finally:
        ray.shutdown()
        test_cluster.shutdown()


def test_each_virtual_gpus_workers_run_on_its_own_core(cluster):
    cfg = config()
    placement = plan_placement(cfg, cluster.gpus_per_node)
    env = core_pinning(cfg, cluster)
    assert env["RLINF_PIPE_HOST_SLOTS"] == "0:0:2,1:1:2"  # both nodes on this host: GPU slots 0 and 1
    groups = [WorkerGroup.launch(CoreProbe, name, comp, cluster, distributed=False, env=env)
              for name, comp in [*placement.components.items(), ("reward", reward_placement(placement))]]
    try:
        actor, rollout, reward = groups
        assert [i.node_rank for i in actor.infos()] == [i.node_rank for i in rollout.infos()] == [0, 1]
        for group in (actor, rollout):  # the two components on a GPU share its core (they take turns on it)
            for rank, cores in enumerate(group.all.call(CoreProbe.cores).wait()):
                mine = [ALLOWED[rank]]
                assert cores == {"method": mine, "compute": mine, "every_thread": mine, "torch_threads": [1],
                                 "pinned": mine}, f"{group.name} rank {rank}"
        (cpu,) = reward.all.call(CoreProbe.cores).wait()
        leftover = ALLOWED[2:] or ALLOWED  # the two GPUs own the first two cores
        assert cpu["method"] == cpu["every_thread"] == cpu["pinned"] == leftover
    finally:
        for group in groups:
            group.shutdown()


def test_no_pinning_leaves_every_core(cluster):
    cfg = config()
    cfg.cluster.cores_per_gpu = None
    placement = plan_placement(cfg, cluster.gpus_per_node)
    assert core_pinning(cfg, cluster) == {}
    group = WorkerGroup.launch(CoreProbe, "actor", placement.components["actor"], cluster, distributed=False)
    try:
        for cores in group.all.call(CoreProbe.cores).wait():
            assert cores["every_thread"] == ALLOWED and cores["pinned"] == []
    finally:
        group.shutdown()
