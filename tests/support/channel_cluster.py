"""The two-node Ray cluster (one machine) that the channel tests run their processes on."""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import Any

import pytest
import ray
from ray.cluster_utils import Cluster as RayTestCluster
from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy


@contextlib.contextmanager
def two_node_cluster(created: list[Any]) -> Iterator[list[str]]:
    """Start two nodes of 2 CPUs and connect; yields [the driver's node id, the other's]. The channels in `created`
    (filled by the tests meanwhile) are aborted before Ray shuts down."""
    cluster = RayTestCluster(initialize_head=True, head_node_args={"num_cpus": 2})
    cluster.add_node(num_cpus=2)
    ray.init(address=cluster.address)
    here = ray.get_runtime_context().get_node_id()
    try:
        yield [here] + [n["NodeID"] for n in ray.nodes() if n["Alive"] and n["NodeID"] != here]
    finally:
        for channel in created:
            channel.abort()
        ray.shutdown()
        cluster.shutdown()


def nodes_fixture(created: list[Any]) -> Any:
    """A module's `nodes` fixture: the cluster of `two_node_cluster(created)` for every test of the module."""

    @pytest.fixture(scope="module")
    def nodes() -> Iterator[list[str]]:
        with two_node_cluster(created) as ids:  # [the driver's node, the other node]
            yield ids

    return nodes


def on_node(actor_cls: Any, node_id: str, **options: Any) -> Any:
    """`actor_cls` pinned to a node."""
    return actor_cls.options(scheduling_strategy=NodeAffinitySchedulingStrategy(node_id, soft=False), **options)
