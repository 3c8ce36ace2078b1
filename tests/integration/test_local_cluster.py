"""Starting a local Ray cluster with virtual GPUs (the laptop path), and its user errors."""

from __future__ import annotations

import sys

import pytest
import ray

from rlinf_pipe.config import load_config
from rlinf_pipe.errors import ClusterError, ConfigError
from rlinf_pipe.runtime.cluster import Cluster
from rlinf_pipe.planning.placement import plan_placement
from rlinf_pipe.runtime.worker import Worker
from rlinf_pipe.runtime.worker_group import WorkerGroup

ray.cloudpickle.register_pickle_by_value(sys.modules[__name__])


class Idle(Worker):
    pass


@pytest.fixture
def no_ray():
    assert not ray.is_initialized(), "another test left Ray running"
    yield
    ray.shutdown()


def test_local_cluster_declares_virtual_gpus_and_places_the_tiny_pipeline(no_ray):
    cfg = load_config(overrides=["cluster.ray_address=local"])
    cluster = Cluster(cfg)
    try:
        assert cluster.started_ray and cluster.gpus_per_node == [2]
        assert ray.cluster_resources()["GPU"] == 2
        placement = plan_placement(cfg, cluster.gpus_per_node)
        groups = {name: WorkerGroup.launch(Idle, name, comp, cluster, distributed=False)
                  for name, comp in placement.components.items()}
        devices = {name: [i.cuda_visible_devices for i in group.infos()] for name, group in groups.items()}
        assert devices == {"rollout": ["0"], "actor": ["1"]}
    finally:
        cluster.shutdown()
    assert not ray.is_initialized()


def test_several_nodes_need_a_running_cluster(no_ray):
    cfg = load_config(overrides=["cluster.ray_address=local", "cluster.num_nodes=2"])
    with pytest.raises(ClusterError, match="no running Ray cluster was given .*; start one with `RANK=n bash"):
        Cluster(cfg)
    assert not ray.is_initialized()


def test_explicit_address_fails_fast_with_message(no_ray):
    with pytest.raises(ClusterError, match="no Ray head answers there"):
        Cluster(load_config(overrides=["cluster.ray_address=127.0.0.1:1"]))
    with pytest.raises(ConfigError, match="cluster.ray_address: 'nonsense' .*not `auto`, `local` or HOST:PORT"):
        load_config(overrides=["cluster.ray_address=nonsense"])  # (refused with the config, before any Ray)
