"""Every host's clock against the driver's, so that the timeline puts the spans of all nodes on one clock.

Spans carry their host's wall clock. Hosts kept in step by NTP or chrony differ by well under a millisecond; one
that is not can be off by seconds, which would move its workers' spans on the timeline and skew every figure read
from it (bubbles, overlap, the weight sync's span from the actor on one node to an engine on another). The driver
asks one worker on each other node for its clock a few times and keeps the offset of the quickest round trip (the
worker read its clock about halfway through it), and shifts that node's spans by it when it collects them (an
offset within that round trip counts as none). It measures again every `RECHECK_S`, as clocks drift, and says once
when a node's clock is off by more than `WARN_S`.
"""

from __future__ import annotations

import asyncio

import msgspec

from rlinf_pipe.runtime.worker import Worker
from rlinf_pipe.runtime.worker_group import WorkerGroup
from rlinf_pipe.utils.tracing import Span, now

SAMPLES = 5  # round trips per node and measure
RECHECK_S = 60.0
WARN_S = 0.05  # an offset the timeline would show


def offset_from_samples(samples: list[tuple[float, float, float]]) -> tuple[float, float]:
    """(offset, round trip) from (sent, remote clock, received) samples: the remote clock less the local one at the
    moment it was read, taken from the quickest round trip, where that moment is known best (its middle)."""
    sent, remote, received = min(samples, key=lambda s: s[2] - s[0])
    return remote - (sent + received) / 2, received - sent


class NodeClocks:
    """Each node's clock offset against the driver's (`offsets`: node rank -> seconds the node's clock is ahead;
    the driver's node, and nodes not measured, count as 0)."""

    def __init__(self, driver_node: int | None):
        self.driver_node = driver_node
        self.offsets: dict[int, float] = {}
        self.measured_at = float("-inf")
        self.warned: set[int] = set()

    def due(self) -> bool:
        return now() - self.measured_at >= RECHECK_S

    async def measure(self, groups: list[WorkerGroup[Worker]]) -> list[str]:
        """Measure through one worker of `groups` on each node but the driver's; returns a warning per node whose
        clock is newly off by more than `WARN_S`."""
        probes: dict[int, tuple[WorkerGroup[Worker], int]] = {}
        for group in groups:
            for rank, proc in enumerate(group.placement.processes):
                if proc.node_rank != self.driver_node:
                    probes.setdefault(proc.node_rank, (group, rank))
        async def sample(group: WorkerGroup[Worker], rank: int) -> list[tuple[float, float, float]]:
            samples = []
            for _ in range(SAMPLES):
                sent = now()
                remote = await group.rank(rank).call(Worker.clock)
                samples.append((sent, remote, now()))
            return samples

        nodes = sorted(probes)
        found = await asyncio.gather(*(sample(*probes[node]) for node in nodes))  # (the nodes at once)
        warnings = []
        for node, samples in zip(nodes, found, strict=True):
            offset, trip = offset_from_samples(samples)
            offset = offset if abs(offset) > trip else 0.0  # (within what one round trip can tell: in step)
            self.offsets[node] = offset
            if abs(offset) > WARN_S and node not in self.warned:
                self.warned.add(node)
                warnings.append(f"node {node}'s clock is {abs(offset):.3f} s {'ahead of' if offset > 0 else 'behind'} "
                                f"the driver's (measured to {trip / 2 * 1e3:.1f} ms): the timeline shifts its spans "
                                "by that much; keep the nodes' clocks in step (chrony or NTP) for exact timelines")
        self.measured_at = now()
        return warnings

    def align(self, spans: list[Span], node: int) -> list[Span]:
        """`spans` of a worker on `node`, on the driver's clock."""
        offset = self.offsets.get(node, 0.0)
        if not offset:
            return spans
        return [msgspec.structs.replace(s, start=s.start - offset, end=s.end - offset) for s in spans]
