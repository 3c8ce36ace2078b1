"""Rendezvous ports drawn before anything binds them: the weight routes of one open, and the worker groups a
driver starts together, never get the same point twice (two stores on one port: the second fails to bind)."""

from __future__ import annotations

from collections import deque
from types import SimpleNamespace

from support.local_group import LocalGroup

from rlinf_pipe.planning.weight_routes import WeightRoute
from rlinf_pipe.runner.weight_sync import WeightSync
from rlinf_pipe.runtime import rendezvous
from rlinf_pipe.utils.tracing import Tracer


def node_offering(address: str, ports: list[int], asked: list[list[int]]):
    """A node whose kernel offers the first of `ports` not avoided (the same one again and again, as a port nothing
    has bound yet stays free); records what each draw avoided."""

    def draw(avoid=()) -> tuple[str, int]:
        asked.append(sorted(avoid))
        return address, next(p for p in ports if p not in avoid)

    return draw


async def test_weight_routes_on_one_node_never_share_a_rendezvous_port(monkeypatch):
    monkeypatch.setattr(rendezvous, "_HANDED_OUT", deque(maxlen=64))
    asked: list[list[int]] = []
    draw = node_offering("10.0.0.1", [20007, 21011, 21012], asked)

    async def free_port(avoid):
        return draw(avoid)

    actor = LocalGroup([SimpleNamespace(free_port=free_port)] * 3)
    sync = WeightSync("broadcast", [WeightRoute(0, ())], actor, {}, verify=False, tracer=Tracer("driver"),
                      actor_phase=None, engines_share_actor=False)
    points = [await sync._distinct_port(rank) for rank in range(3)]
    assert points == [("10.0.0.1", 20007), ("10.0.0.1", 21011), ("10.0.0.1", 21012)]
    assert asked == [[], [20007], [20007, 21011]]  # one call each: the node avoids what was handed out


def test_worker_groups_started_together_get_distinct_rendezvous_points(monkeypatch):
    here = SimpleNamespace(node_id="n0", node_rank=0)
    monkeypatch.setattr(rendezvous.ray, "get_runtime_context", lambda: SimpleNamespace(get_node_id=lambda: "n0"))
    monkeypatch.setattr(rendezvous, "_HANDED_OUT", deque(maxlen=64))
    asked: list[list[int]] = []
    monkeypatch.setattr(rendezvous, "free_port_here", node_offering("10.0.0.1", [20500, 20501], asked))
    assert [rendezvous.rendezvous_point(here) for _ in range(2)] == [("10.0.0.1", 20500), ("10.0.0.1", 20501)]
    assert asked == [[], [20500]]


def test_groups_and_weight_routes_avoid_one_list(monkeypatch):
    """A port a group was handed is avoided by a weight route's draw, and the other way round; the list keeps the
    last 64."""
    monkeypatch.setattr(rendezvous, "_HANDED_OUT", deque(maxlen=64))
    assert rendezvous.hand_out(("10.0.0.1", 20500)) == ("10.0.0.1", 20500)
    assert rendezvous.handed_out_ports() == [20500]
    for port in range(21000, 21064):
        rendezvous.hand_out(("10.0.0.2", port))
    assert rendezvous.handed_out_ports() == list(range(21000, 21064))
