"""Deterministic node order: head first, then the RANK label, then IP."""

from __future__ import annotations

import pytest

from rlinf_pipe.errors import ClusterError
from rlinf_pipe.runtime.cluster import HEAD_RESOURCE, NODE_RANK_LABEL, order_nodes


def node(node_id: str, ip: str, gpus: int, rank: str | None = None, head: bool = False, alive: bool = True):
    resources = {"GPU": float(gpus), "CPU": 8.0}
    if head:
        resources[HEAD_RESOURCE] = 1.0
    labels = {"ray.io/node-id": node_id}
    if rank is not None:
        labels[NODE_RANK_LABEL] = rank
    return {"NodeID": node_id, "NodeManagerAddress": ip, "Resources": resources, "Labels": labels, "Alive": alive}


def test_head_first_then_rank_label_then_ip():
    nodes = order_nodes([
        node("d", "10.0.0.9", 8, rank="3"),
        node("e", "10.0.0.2", 16),  # no label: after every labelled node, by IP
        node("b", "10.0.0.7", 4, rank="1"),
        node("a", "10.0.0.5", 8, rank="0", head=True),
        node("f", "10.0.0.10", 8),
        node("c", "10.0.0.1", 8, rank="2"),
        node("x", "10.0.0.3", 8, rank="4", alive=False),
    ])
    assert [n.node_id for n in nodes] == ["a", "b", "c", "d", "e", "f"]
    assert [n.node_rank for n in nodes] == [0, 1, 2, 3, 4, 5]
    assert [n.num_gpus for n in nodes] == [8, 4, 8, 8, 16, 8]
    assert nodes[0].is_head and nodes[1].rank_label == 1


def test_ip_order_is_numeric_not_lexical():
    nodes = order_nodes([node("a", "10.0.0.10", 1), node("b", "10.0.0.9", 1), node("h", "10.0.0.50", 1, head=True)])
    assert [n.ip for n in nodes] == ["10.0.0.50", "10.0.0.9", "10.0.0.10"]


def test_duplicate_rank_labels_are_an_error():
    with pytest.raises(ClusterError, match="two nodes were started with RANK=1"):
        order_nodes([node("a", "10.0.0.1", 8, rank="1"), node("b", "10.0.0.2", 8, rank="1")])
