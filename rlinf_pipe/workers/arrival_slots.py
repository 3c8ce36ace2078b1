"""Mini-batches in the order groups finish (`algorithm.minibatch_order: arrival`): one small Ray actor per job.

A group's slot fixes its mini-batch and actor replica (`rlinf_pipe.data.routing`). By default it is the prompt's
position in the batch, so a mini-batch is complete only once its slowest group is generated; with long, varied
responses nearly every mini-batch holds one of the step's slowest groups, and the actor can train little before
generation ends. In arrival order each scored group takes the next free slot instead, so the first mini-batch is
the first groups to finish and trains while the rest generate. The reward workers take slots here; the driver resets
the count before each step's scoring (one step is scored at a time, the next once the one before is done).
"""

from __future__ import annotations

import ray


class SlotCounter:
    """The next free slot of the step being scored."""

    def __init__(self) -> None:
        self.taken = 0

    def reset(self) -> None:
        self.taken = 0

    def offer(self, rewards: list[float]) -> int:
        """A scored group (its rewards, unused: every group is kept): its slot."""
        self.taken += 1
        return self.taken - 1


ArrivalSlots = ray.remote(num_cpus=0)(SlotCounter)
