"""Actor replicas by tokens (`algorithm.replica_routing: tokens`): one small Ray actor per job that every stage
writing the train channels asks where each group goes (`rlinf_pipe.data.routing.TokenBalance`).

By slot, a mini-batch's groups go round-robin over the replicas whatever their lengths; with long, varied responses
one replica often gets far more tokens than the others, and they all wait for it at the optimizer step. Here each
group, as it arrives, goes to the replica with the fewest tokens so far in its mini-batch among those with room.
The counts per replica stay as by slot, so each replica still knows when its part of a mini-batch is complete.
The driver begins each step's routing before the step's scoring (`begin`); a step retried after a lost worker
begins afresh.
"""

from __future__ import annotations

from typing import Any

import ray

from rlinf_pipe.data.routing import TokenBalance, TrainRouting


KEPT_STEPS = 16  # steps whose routing is kept: a step's log-prob stage may still route while later steps are
# scored (`runner.max_staleness`), and a few integers a step cost nothing


class ReplicaBalance:
    """The token balance of the steps being routed (a step's log-prob stage may still route while later ones are
    scored)."""

    def __init__(self, routing: TrainRouting) -> None:
        self.routing = routing
        self.steps: dict[int, TokenBalance] = {}

    def begin(self, step: int) -> None:
        """Route step `step` from scratch (forgetting steps `KEPT_STEPS` or more before it, and any after it: those
        are begun again when a run goes back to an earlier step)."""
        self.steps = {s: b for s, b in self.steps.items() if step - KEPT_STEPS < s < step}
        self.steps[step] = TokenBalance(self.routing)

    def assign(self, step: int, slot: int, tokens: int) -> int:
        """The replica that trains the group of `slot` (`tokens` real tokens) in step `step`."""
        if step not in self.steps:
            raise ValueError(f"replica balance: step {step} was not begun (steps begun: {sorted(self.steps)})")
        return self.steps[step].assign(slot, tokens)


ReplicaBalancer: Any = ray.remote(num_cpus=0)(ReplicaBalance)


class TrainRoute:
    """Which actor replica's train channel a stage puts a group into: by slot, or asked of the job's
    `ReplicaBalancer` (`balancer`) by tokens."""

    def __init__(self, routing: TrainRouting, balancer: Any = None) -> None:
        self.routing, self.balancer = routing, balancer

    async def replica(self, step: int, batch: Any) -> int:
        """The replica for `batch` (a `TrainBatch` of one group, its `slot` set) in step `step`."""
        if self.balancer is None:
            return self.routing.replica_of(batch.slot)
        return await self.balancer.assign.remote(step, batch.slot, int(batch.attention_mask.sum()))
