"""`death_cause`: the sentence of Ray's error that says why a worker's process is gone."""

from __future__ import annotations

from ray.exceptions import NodeDiedError, OutOfMemoryError, RayTaskError

from rlinf_pipe.utils.worker_death import CALL_FAILED, GONE, MEMORY_MONITOR_FIX, death_cause

# The shape of Ray 2.60's message when its memory monitor killed a worker (tests/integration/test_memory_monitor.py
# makes a real one)
MONITOR = """1 worker(s) were killed due to the node running low on memory. Memory on the node (IP: 10.0.0.5, ID: \
9c44c493ea536d725886d39a34535f55b9c390541bad436bd730c6df) was 22.6GB used / 23.54GB limit (0.96)
OOM kill reason: Memory usage 24266862592B exceeded threshold of 24012688588B (95.0% of 25276514304B limit)
Object store memory usage: [- objects spillable: 0
- bytes spillable: 0]
Ray killed 1 worker(s) based on the killing policy"""


def test_the_memory_monitor_says_how_full_the_node_was_and_what_to_change():
    said = death_cause(OutOfMemoryError(MONITOR))
    assert said.startswith("1 worker(s) were killed due to the node running low on memory. Memory on the node "
                           "(IP: 10.0.0.5) was 22.6GB used / 23.54GB limit (0.96) OOM kill reason: Memory usage")
    assert "Object store" not in said and "9c44c493" not in said and said.endswith(MEMORY_MONITOR_FIX)


def test_other_losses_keep_rays_first_line():
    said = death_cause(NodeDiedError("The node with node id abc has died.\nmore"))
    assert said == "The node with node id abc has died."


def test_every_way_ray_reports_a_gone_process_is_a_failed_call():
    assert OutOfMemoryError in GONE and NodeDiedError in GONE
    assert set(GONE) < set(CALL_FAILED) and RayTaskError in CALL_FAILED
