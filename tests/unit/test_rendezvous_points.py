"""Rendezvous ports drawn before anything binds them: the weight routes of one open, and the worker groups a
driver starts together, never get the same point twice (two stores on one port: the second fails to bind)."""

from __future__ import annotations

from types import SimpleNamespace

import pytest

from rlinf_pipe.errors import ClusterError
from rlinf_pipe.runner.weight_routes import WeightRoute
from rlinf_pipe.runner.weight_sync import WeightSync
from rlinf_pipe.scheduler import worker_group
from rlinf_pipe.utils.tracing import Tracer


def drawing(points: list[tuple[str, int]]):
    draws = iter(points)
    return lambda: next(draws)


async def test_weight_routes_on_one_node_never_share_a_rendezvous_port(monkeypatch):
    monkeypatch.setattr(worker_group, "_RECENT_POINTS", worker_group.deque(maxlen=64))
    draw = drawing([("10.0.0.1", 20007), ("10.0.0.1", 20007), ("10.0.0.2", 20007), ("10.0.0.1", 20007),
                    ("10.0.0.1", 21011)])

    async def free_port():
        return draw()

    actor = SimpleNamespace(rank=lambda rank: SimpleNamespace(free_port=free_port))
    sync = WeightSync("broadcast", [WeightRoute(0, ())], actor, {}, verify=False, tracer=Tracer("driver"),
                      actor_phase=None, engines_share_actor=False)
    points = [await sync._distinct_port(rank) for rank in range(3)]
    assert points == [("10.0.0.1", 20007), ("10.0.0.2", 20007), ("10.0.0.1", 21011)]


def test_worker_groups_started_together_get_distinct_rendezvous_points(monkeypatch):
    here = SimpleNamespace(node_id="n0", node_rank=0)
    monkeypatch.setattr(worker_group.ray, "get_runtime_context", lambda: SimpleNamespace(get_node_id=lambda: "n0"))
    monkeypatch.setattr(worker_group, "_RECENT_POINTS", worker_group.deque(maxlen=64))
    monkeypatch.setattr(worker_group, "_free_port_on_node",
                        drawing([("10.0.0.1", 20500), ("10.0.0.1", 20500), ("10.0.0.1", 20501)]))
    assert [worker_group._rendezvous_point(here) for _ in range(2)] == [("10.0.0.1", 20500), ("10.0.0.1", 20501)]
    monkeypatch.setattr(worker_group, "_free_port_on_node", lambda: ("10.0.0.1", 20500))
    with pytest.raises(ClusterError, match="distinct from the last ones handed out in 3 draws"):
        worker_group._rendezvous_point(here, draws=3)


def test_groups_and_weight_routes_draw_from_one_registry(monkeypatch):
    """A point a group was handed is drawn again by a weight route, and the other way round."""
    monkeypatch.setattr(worker_group, "_RECENT_POINTS", worker_group.deque(maxlen=64))
    assert worker_group.claim_point(("10.0.0.1", 20500)) and not worker_group.claim_point(("10.0.0.1", 20500))
    assert worker_group.claim_point(("10.0.0.2", 20500))
