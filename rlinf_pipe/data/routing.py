"""Where each prompt group of a step trains: its mini-batch and its actor replica, decided by its slot.

A slot is a group's position in the step's batch (0 .. groups-1): the driver gives prompts their slots when it
dispatches them, or, with dynamic sampling, the reward stage gives each kept group the next free slot. The step's
`groups` slots split into `n_minibatches` consecutive mini-batches (one optimizer step each); within a mini-batch
the slots go round-robin over the `dp` actor replicas. So membership never depends on arrival order, and every
replica knows in advance how many groups it trains in each mini-batch.

`TokenBalance` (`algorithm.replica_routing: tokens`) keeps the mini-batches and the number of groups each replica
trains in each, but sends each arriving group to the replica with the fewest tokens so far in its mini-batch among
those with room: long groups no longer pile up on one replica, which the others wait for at the optimizer step.
Which replica trains a group then depends on arrival order (float rounding only: the mini-batch is the same).
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class TrainRouting:
    """Slot -> (mini-batch, actor replica) for a step of `groups` groups (see the module docstring)."""

    groups: int
    n_minibatches: int
    dp: int

    def __post_init__(self) -> None:
        if self.groups < 1 or self.n_minibatches < 1 or self.dp < 1 or self.groups % self.n_minibatches:
            raise ValueError(
                f"need groups >= 1, n_minibatches >= 1 dividing them, dp >= 1; got groups={self.groups}, "
                f"n_minibatches={self.n_minibatches}, dp={self.dp}"
            )

    @property
    def per_minibatch(self) -> int:
        return self.groups // self.n_minibatches

    def _check(self, slot: int) -> None:
        if not 0 <= slot < self.groups:
            raise ValueError(f"slot {slot} is outside the step's {self.groups} groups (0-{self.groups - 1})")

    def minibatch_of(self, slot: int) -> int:
        self._check(slot)
        return slot // self.per_minibatch

    def replica_of(self, slot: int) -> int:
        self._check(slot)
        return (slot % self.per_minibatch) % self.dp

    def expected(self, minibatch: int, replica: int) -> int:
        """How many groups `replica` trains in `minibatch` when the step is full."""
        base, extra = divmod(self.per_minibatch, self.dp)
        return base + (1 if replica < extra else 0)


class TokenBalance:
    """Replicas for the arriving groups of one step by tokens (see the module docstring): `assign(slot, tokens)`
    picks, among the replicas that still have room in the slot's mini-batch (`TrainRouting.expected`), the one
    with the fewest tokens assigned there so far (the lowest index on a tie)."""

    def __init__(self, routing: TrainRouting):
        self.routing = routing
        self.tokens = [[0] * routing.dp for _ in range(routing.n_minibatches)]
        self.groups = [[0] * routing.dp for _ in range(routing.n_minibatches)]

    def assign(self, slot: int, tokens: int) -> int:
        minibatch = self.routing.minibatch_of(slot)
        room = [r for r in range(self.routing.dp) if self.groups[minibatch][r] < self.routing.expected(minibatch, r)]
        if not room:
            raise ValueError(f"mini-batch {minibatch} already has its {self.routing.per_minibatch} groups (slot {slot} "
                             "is one too many)")
        replica = min(room, key=lambda r: self.tokens[minibatch][r])
        self.tokens[minibatch][replica] += tokens
        self.groups[minibatch][replica] += 1
        return replica
